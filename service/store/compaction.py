"""Rollups built behind the ingest path, from complete blocks (issue 21).

A batch commits its raw points only (plus the blocks of any steps that arrive behind the frontier); each rank's
``compacted_step`` frontier says up to where every rollup block is complete. Once a rank's newest step has moved past
one or more whole base blocks, :meth:`Compactor.compact` builds them and every level above from the raw points in a
transaction of its own and moves the frontier. Reads use blocks that end before the frontier and the raw points after
it, so they are exact whatever the frontier; a crash between a batch's commit and the compaction loses nothing (the
points are committed) and duplicates nothing (the next compaction of the rank rebuilds its blocks from raw).
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import Connection, bindparam, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Point, Run, RunRank
from quantwatch.service.rollups import F32, I64, LEVELS, group_starts, rows_from_blobs
from quantwatch.service.store.rollup_writes import RollupWriter

BLOCK_STEPS = LEVELS[0]


def frontier_after(last_step: int) -> int:
    """The frontier once every base block before the one holding ``last_step`` is built."""
    return last_step // BLOCK_STEPS * BLOCK_STEPS


_FRONTIER = select(RunRank.compacted_step).where(
    RunRank.run_id == bindparam("run_id"), RunRank.rank == bindparam("rank")
)


def read_frontier(conn: Connection, run_id: int, rank: int) -> int:
    """The rank's ``compacted_step`` (0 for a rank with nothing stored yet)."""
    value = conn.execute(_FRONTIER, {"run_id": run_id, "rank": rank}).scalar_one_or_none()
    return 0 if value is None else int(value)


class Compactor:
    """Builds the complete blocks of a rank from its raw points and moves its frontier."""

    def __init__(self, factory: sessionmaker[Session], rollups: RollupWriter, pg: bool) -> None:
        self.factory = factory
        self.rollups = rollups
        self.pg = pg

    def compact(self, run_id: int, rank: int, lock_key: int, *, whole: bool = False) -> int:
        """Build every base block of (run, rank) between its frontier and the block of its last step (``whole``:
        that block too, so the frontier passes the last step), in one transaction under the rank's write lock
        (``lock_key`` on PostgreSQL); return the new frontier (unchanged when nothing was due)."""
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
                target = last_step + 1 if whole else frontier_after(last_step)
                if target <= frontier:
                    session.rollback()
                    return frontier
                start = frontier // BLOCK_STEPS * BLOCK_STEPS  # whole blocks: a frontier from before 0004 may not be
                matrices = self._raw_blocks(conn, run_id, rank, start, target, n_layers)
                if matrices:
                    self.rollups.write(conn, run_id, rank, matrices, set(), n_layers, merge=False)
                conn.execute(
                    update(RunRank).where(RunRank.run_id == run_id, RunRank.rank == rank).values(compacted_step=target)
                )
                session.commit()
            except BaseException:
                session.rollback()
                raise
        return target

    @staticmethod
    def _raw_blocks(
        conn: Connection, run_id: int, rank: int, lo: int, hi: int, n_layers: int
    ) -> dict[int, tuple[I64, F32]]:
        """Every raw point of the rank with lo <= step < hi, as (steps, values) per name id, step order."""
        rows = conn.execute(
            select(Point.name_id, Point.step, Point.vals)
            .where(Point.run_id == run_id, Point.rank == rank, Point.step >= lo, Point.step < hi)
            .order_by(Point.name_id, Point.step)
        ).all()
        if not rows:
            return {}
        nids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        steps = np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows))
        values = rows_from_blobs([bytes(r[2]) for r in rows], n_layers)
        keys, starts = group_starts(nids)
        ends = [*starts[1:].tolist(), len(rows)]
        return {
            int(nid): (steps[a:b], values[a:b]) for nid, a, b in zip(keys.tolist(), starts.tolist(), ends, strict=True)
        }
