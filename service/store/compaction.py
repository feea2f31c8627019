"""Rollups built behind the ingest path, from complete blocks (issue 21).

A batch commits its raw points only (plus the blocks of any steps that arrive behind the frontier); each rank's
``compacted_step`` frontier says up to where every rollup block is complete. Once a rank's newest step has passed an
edge beyond its frontier (:func:`edge_steps`: every base block's for densely sampled steps, every :data:`COMPACT_STEPS`
for sparse ones), :meth:`Compactor.compact` builds the base blocks up to that edge and every level above from the raw
points in a transaction of its own and moves the frontier there; a rank whose complete blocks wait behind no such edge
for :data:`IDLE_SECONDS` is compacted by the collector's sweeper (:meth:`Compactor.compact_idle`). Reads use blocks that
end before the frontier and the raw points after it, so they are exact whatever the frontier; a crash between a batch's
commit and the compaction loses nothing (the points are committed) and duplicates nothing (the next compaction of the
rank rebuilds its blocks from raw). With folding on (the ``fold_chunks`` setting, the default), a compaction that moved
the frontier then queues the rank for the background folder (:mod:`.fold_worker`), which folds the raw rows behind the
frontier into compressed chunks off the ingest path; off, compaction builds the blocks only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Run, RunRank
from quantwatch.service.rollups import LEVELS
from quantwatch.service.store.fold_worker import FoldWorker
from quantwatch.service.store.group_commit import GroupCommit
from quantwatch.service.store.raw_points import merge
from quantwatch.service.store.rollup_writes import MIN_BLOCK_SAMPLES, RollupWriter

BLOCK_STEPS = LEVELS[0]
COMPACT_STEPS = 4 * BLOCK_STEPS
"""The edges a batch of sparsely sampled steps moves its rank's frontier to: multiples of this many steps (a level's
block, 256). A compaction's cost is mostly fixed (its transaction and commit, the reads and writes of the parent
levels' blocks, and each parent whose children are not all stored read again from raw), and with few samples per base
block (at the agent's ``every=25``, 2.5) a one-step batch crossed a base block's edge in 39% of batches, which cost it
4× per step what a 16-step batch pays (that moves the frontier by ~6 blocks at once); so it is paid once per this many
steps. From one edge to the next a compaction combines the 128- and 256-step blocks from the base blocks it has just
built, none read again from raw (unless a base block holds no sample). The raw tail after the frontier is then up to
``2 × COMPACT_STEPS - 1`` steps long: densely sampled steps, whose blocks amortise a compaction already and whose tail
would weigh more (on PostgreSQL its deleted rows too, until a vacuum), keep the base block's edges."""
DENSE_STEPS = BLOCK_STEPS // MIN_BLOCK_SAMPLES
"""Steps between two samples up to which sampling is dense: each base block then holds enough samples to be stored."""
IDLE_SECONDS = 30.0
"""How long a rank whose complete blocks wait behind no edge of its batches goes without a batch before the sweeper
compacts it (a rank that stopped sending is compacted eventually, and folded after)."""


def edge_steps(steps: Sequence[int], previous_step: int) -> int:
    """The spacing of the edges a batch of ``steps`` (sorted) compacts its rank to, given the rank's newest step
    before it (``previous_step``, -1: none): :data:`BLOCK_STEPS` when its steps are sampled densely (at most
    :data:`DENSE_STEPS` apart, within the batch or, for one step, from the rank's previous one), else
    :data:`COMPACT_STEPS`."""
    if len(steps) > 1:
        dense = steps[-1] - steps[0] <= DENSE_STEPS * (len(steps) - 1)
    else:
        dense = 0 <= previous_step < steps[0] <= previous_step + DENSE_STEPS
    return BLOCK_STEPS if dense else COMPACT_STEPS


def last_edge(step: int, edge: int) -> int:
    """The last edge (a multiple of ``edge`` steps) at or before ``step``: where a compaction moves the frontier."""
    return step // edge * edge


def compaction_due(frontier: int, last_step: int, edge: int) -> bool:
    """Whether a batch whose newest step is ``last_step`` compacts a rank at ``frontier`` to edges ``edge`` apart."""
    return last_edge(last_step, edge) > frontier


class Compactor:
    """Builds the complete blocks of a rank from its raw points and moves its frontier."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        rollups: RollupWriter,
        pg: bool,
        group: GroupCommit | None,
        *,
        fold: bool,
    ) -> None:
        """``group``: the SQLite writers' group commit (None on PostgreSQL), which the folder's writes join."""
        self.factory = factory
        self.rollups = rollups
        self.points = rollups.points
        self.folds = FoldWorker(factory, group) if fold else None
        self.pg = pg

    def compact(self, run_id: int, rank: int, lock_key: int, edge: int = BLOCK_STEPS, *, whole: bool = False) -> int:
        """Build every base block of (run, rank) between its frontier and the last edge (a multiple of ``edge``
        steps) at or before its last step (``whole``: up to its last step, so the frontier passes it), in one
        transaction under the rank's write lock (``lock_key`` on PostgreSQL); return the new frontier (unchanged when
        nothing was due). With folding on, a moved frontier queues the rank for the folder."""
        with self.factory() as session:
            conn = session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            try:
                if self.pg:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key})
                row = conn.execute(
                    select(RunRank.compacted_step, RunRank.last_step, Run.layer_count)
                    .join(Run, Run.id == RunRank.run_id)
                    .where(RunRank.run_id == run_id, RunRank.rank == rank)
                ).first()
                if row is None:  # the run was deleted meanwhile
                    session.rollback()
                    return 0
                frontier, last_step, n_layers = int(row[0]), int(row[1]), int(row[2])
                target = last_step + 1 if whole else last_edge(last_step, edge)
                if target <= frontier:
                    session.rollback()
                    return frontier
                tail = self.points.rank_tail(conn, run_id, rank, frontier, target, n_layers)
                start = frontier // BLOCK_STEPS * BLOCK_STEPS  # whole blocks: a frontier may not be on a block's edge
                if start < frontier:  # (after compact_all, or from before 0004): the rows before it may be folded
                    heads = self.points.read_many(conn, run_id, rank, list(tail), start, frontier - 1, n_layers)
                    tail = {nid: merge([heads[nid], rows]) for nid, rows in tail.items()}
                matrices = {nid: (rows.steps, rows.values) for nid, rows in tail.items()}
                if matrices:
                    self.rollups.write(conn, run_id, rank, matrices, set(), n_layers, target)
                conn.execute(
                    update(RunRank).where(RunRank.run_id == run_id, RunRank.rank == rank).values(compacted_step=target)
                )
                session.commit()
            except BaseException:
                session.rollback()
                raise
        if self.folds is not None and not whole:  # compact_all folds the rank itself once it is compacted
            self.folds.request(run_id, rank, lock_key)
        return target

    def compact_idle(
        self,
        seen_before: float,
        lock_key: Callable[[int, int], int],
        exclusive: Callable[[], AbstractContextManager[None]],
    ) -> int:
        """Build the complete blocks of every rank with some not built whose last batch came before ``seen_before``
        (seconds since the epoch), each in a transaction of its own (``exclusive``: the writer's slot on SQLite;
        ``lock_key``: a rank's PostgreSQL advisory lock key); return how many ranks it compacted. Replicas may run it
        side by side: a rank compacted by one finds nothing due in the other."""
        due = RunRank.last_step // BLOCK_STEPS * BLOCK_STEPS > RunRank.compacted_step
        with self.factory() as session:
            ranks = session.execute(
                select(RunRank.run_id, RunRank.rank)
                .where(due, RunRank.last_seen_at < seen_before)
                .order_by(RunRank.run_id, RunRank.rank)
            ).all()
        for run_id, rank in ranks:
            with exclusive():
                self.compact(int(run_id), int(rank), lock_key(int(run_id), int(rank)))
        return len(ranks)
