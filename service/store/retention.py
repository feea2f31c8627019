"""Retention (issue 21): a rank's old raw points dropped while their rollups stay, off unless configured.

A :class:`RetentionPolicy` keeps raw points for the newest ``steps`` steps of each rank and/or for ``age_seconds`` by
their step's time; a point outside either window is due. Only points behind the rank's compaction frontier are ever
dropped, in whole base blocks (:data:`BLOCK_STEPS`), so every rollup level still holds them exactly; folded chunks go
whole, and a chunk that straddles the cut is re-encoded with the rows after it. ``run_ranks.raw_from_step`` records
the cut: reads answer the steps before it from the rollups (:mod:`.reads`), and ingest keeps no metric values for a
step behind it (its block is final: a re-sent value there could not be merged into a min or a max without the raw
points it replaced).

Each (run, rank) is looked at without a lock; when something is due, it is swept in a transaction of its own under
the rank's write lock (PostgreSQL: its advisory lock; SQLite: the one writer), which works the cut out again under the
lock, so two replicas sweeping at once drop each point once and never move a cut backwards. One transaction drops at
most :data:`STEPS_PER_PASS` steps of one rank; a sweep visits at most ``max_ranks`` ranks, carrying on where the
previous sweep stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, delete, func, insert, or_, select, text, tuple_, update
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Point, PointChunk, Run, RunMetric, RunRank
from quantwatch.service.store.chunk_codec import HEADER_SIZE, decode_steps, decode_times, values_shape
from quantwatch.service.store.compaction import BLOCK_STEPS
from quantwatch.service.store.folding import chunk_row
from quantwatch.service.store.raw_points import decode_chunk, times_array
from quantwatch.service.store.rollup_writes import RollupWriter, read_raw_from

STEPS_PER_PASS = 4096
"""The most steps of one rank whose raw points one transaction drops (bounds the rows a transaction deletes)."""

_RANK = (RunRank.run_id == bindparam("run_id"), RunRank.rank == bindparam("rank"))
_POINTS = (Point.run_id == bindparam("run_id"), Point.rank == bindparam("rank"))
_CHUNKS = (PointChunk.run_id == bindparam("run_id"), PointChunk.rank == bindparam("rank"))


@dataclass(frozen=True)
class RetentionPolicy:
    """How long raw points are kept: the newest ``steps`` steps of each rank and/or ``age_seconds`` by their step's
    time (None: no limit of that kind; both None: retention off, every raw point kept)."""

    steps: int | None = None
    age_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)):
            raise ValueError(f"retention_steps: must be a whole number of steps >= 1, got {self.steps!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"retention_steps: must be >= 1, got {self.steps}")
        age = self.age_seconds
        if age is not None and (isinstance(age, bool) or not isinstance(age, int | float)):
            raise ValueError(f"retention_age: must be a number of seconds > 0, got {age!r}")
        if age is not None and not (math.isfinite(age) and age > 0):
            raise ValueError(f"retention_age: must be a finite number of seconds > 0, got {age}")

    @property
    def enabled(self) -> bool:
        """Whether anything is ever dropped."""
        return self.steps is not None or self.age_seconds is not None


@dataclass(frozen=True)
class RetentionPass:
    """What one sweep did: (run, rank)s whose cut moved, raw rows (and chunk rows) dropped, and raw points dropped
    (one value of one series at one step: rows × their layers)."""

    ranks: int = 0
    rows: int = 0
    points: int = 0

    def __add__(self, other: RetentionPass) -> RetentionPass:
        return RetentionPass(self.ranks + other.ranks, self.rows + other.rows, self.points + other.points)


def keep_retained(
    conn: Connection, run_id: int, rank: int, entries: dict[str, list[Any]], frontier: int
) -> dict[str, list[Any]]:
    """The ingest path's ``(step, …)`` entries per metric (each list in step order) without those of steps behind the
    rank's retention cut (see the module). Read in the batch's transaction, under the rank's write lock; a batch
    wholly at or past the frontier (the usual case) costs no read, as the cut never passes the frontier."""
    if all(found[0][0] >= frontier for found in entries.values()):
        return entries
    cut = read_raw_from(conn, run_id, rank)
    if not cut:
        return entries
    kept = {name: [e for e in found if e[0] >= cut] for name, found in entries.items()}
    return {name: found for name, found in kept.items() if found}


class Retention:
    """Drops what a policy makes due of each rank's raw points (statements built once)."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        pg: bool,
        exclusive: Callable[[], AbstractContextManager[None]],
        lock_key: Callable[[int, int], int],
        rollups: RollupWriter,
    ) -> None:
        """``exclusive``: the writer's slot between ingest groups (SQLite); ``lock_key``: the PostgreSQL advisory
        lock key of a (run, rank), the one ingest and the compactor take; ``rollups``: the store's rollup writer."""
        self.factory = factory
        self._rollups = rollups
        self._metrics = select(RunMetric.name_id).where(
            RunMetric.run_id == bindparam("run_id"), RunMetric.kind == "layer"
        )
        self.pg = pg
        self._exclusive = exclusive
        self._lock_key = lock_key
        self._after: tuple[int, int] | None = None
        progress = (RunRank.compacted_step, RunRank.first_step, RunRank.last_step, RunRank.raw_from_step)
        self._rank = select(*progress, Run.layer_count).join(Run, Run.id == RunRank.run_id).where(*_RANK)
        window = (Point.step >= bindparam("lo"), Point.step < bindparam("hi"))
        self._young_raw = select(func.min(Point.step)).where(
            *_POINTS, *window, or_(Point.time.is_(None), Point.time >= bindparam("cutoff"))
        )
        chunk_window = (PointChunk.last_step >= bindparam("lo"), PointChunk.first_step < bindparam("hi"))
        self._chunk_times = (
            select(PointChunk.rows, PointChunk.steps, PointChunk.times)
            .where(*_CHUNKS, *chunk_window)
            .order_by(PointChunk.first_step)
        )
        behind = Point.step < bindparam("cut")
        self._raw_size = select(func.count(), func.coalesce(func.sum(func.length(Point.vals)), 0)).where(
            *_POINTS, behind
        )
        self._raw_delete = delete(Point).where(*_POINTS, behind)
        whole = PointChunk.last_step < bindparam("cut")
        self._whole_chunks = select(func.substr(PointChunk.vals, 1, HEADER_SIZE)).where(*_CHUNKS, whole)
        self._whole_delete = delete(PointChunk).where(*_CHUNKS, whole)
        chunk = (PointChunk.rows, PointChunk.steps, PointChunk.times, PointChunk.vals)
        straddling = (PointChunk.first_step < bindparam("cut"), PointChunk.last_step >= bindparam("cut"))
        self._straddling = select(PointChunk.name_id, PointChunk.first_step, *chunk).where(*_CHUNKS, *straddling)
        self._chunk_delete = delete(PointChunk).where(
            *_CHUNKS, PointChunk.name_id == bindparam("nid"), PointChunk.first_step == bindparam("first")
        )

    def sweep(self, policy: RetentionPolicy, now: float, *, max_ranks: int | None = None) -> RetentionPass:
        """Visit the ranks that may have raw points due (at most ``max_ranks`` of them, after the last one the
        previous sweep visited) and drop what is due of each, one transaction per rank."""
        if not policy.enabled:
            return RetentionPass()
        due = RunRank.compacted_step >= RunRank.raw_from_step + BLOCK_STEPS
        if policy.age_seconds is None and policy.steps is not None:
            due &= RunRank.last_step + 1 - policy.steps >= RunRank.raw_from_step + BLOCK_STEPS
        candidates = select(RunRank.run_id, RunRank.rank).where(due).order_by(RunRank.run_id, RunRank.rank)
        if self._after is not None:
            candidates = candidates.where(tuple_(RunRank.run_id, RunRank.rank) > tuple_(*self._after))
        if max_ranks is not None:
            candidates = candidates.limit(max_ranks)
        with self.factory() as session:
            ranks = [(int(r), int(k)) for r, k in session.execute(candidates)]
        complete = max_ranks is None or len(ranks) < max_ranks
        self._after = None if complete or not ranks else ranks[-1]
        done = RetentionPass()
        for run_id, rank in ranks:
            done += self.apply(run_id, rank, policy, now)
        return done

    def apply(self, run_id: int, rank: int, policy: RetentionPolicy, now: float) -> RetentionPass:
        """Drop what ``policy`` makes due of (run, rank)'s raw points, at most STEPS_PER_PASS steps of them, in one
        transaction under the rank's write lock."""
        key = {"run_id": run_id, "rank": rank}
        with self.factory() as session:  # a look without the write lock first: most visits find nothing due
            if self._due(session.connection(), key, policy, now) is None:
                return RetentionPass()
        with self._exclusive(), self.factory() as session:
            conn = session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            try:
                if self.pg:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": self._lock_key(run_id, rank)})
                due = self._due(conn, key, policy, now)  # again under the lock: another sweeper may have been first
                if due is None:
                    session.rollback()
                    return RetentionPass()
                cut, n_layers, raw_from = due
                done = self._drop(conn, key, raw_from, cut, n_layers)
                moved = update(RunRank).where(RunRank.run_id == run_id, RunRank.rank == rank)
                conn.execute(moved.values(raw_from_step=cut))
                session.commit()
            except BaseException:
                session.rollback()
                raise
        return done

    def _due(
        self, conn: Connection, key: dict[str, int], policy: RetentionPolicy, now: float
    ) -> tuple[int, int, int] | None:
        """The rank's new cut, the run's layer count and the cut before, or None when the cut would not move (or the
        run is gone)."""
        row = conn.execute(self._rank, key).first()
        if row is None:
            return None
        cut = self._cut(conn, key, policy, now, *map(int, row[:4]))
        return None if cut is None else (cut, int(row[4]), int(row[3]))

    def _cut(
        self,
        conn: Connection,
        key: dict[str, int],
        policy: RetentionPolicy,
        now: float,
        frontier: int,
        first_step: int,
        last_step: int,
        raw_from: int,
    ) -> int | None:
        """The rank's new cut (a base block boundary at or behind the frontier), or None when it would not move."""
        start = max(raw_from, first_step // BLOCK_STEPS * BLOCK_STEPS)
        cap = min(frontier, start + STEPS_PER_PASS) // BLOCK_STEPS * BLOCK_STEPS
        if cap <= raw_from:
            return None
        due = -1
        if policy.steps is not None:
            due = last_step + 1 - policy.steps
        if policy.age_seconds is not None and due < cap:
            due = max(due, self._first_young(conn, key, start, cap, now - policy.age_seconds))
        cut = min(due, cap) // BLOCK_STEPS * BLOCK_STEPS
        return cut if cut > raw_from else None

    def _first_young(self, conn: Connection, key: dict[str, int], lo: int, hi: int, cutoff: float) -> int:
        """The first step in [lo, hi) of a raw row or chunk row whose time is ``cutoff`` or later, or that has no
        time (its age is unknown, so it is kept); ``hi`` when every row there is older."""
        window = {**key, "lo": lo, "hi": hi}
        found = conn.execute(self._young_raw, {**window, "cutoff": cutoff}).scalar()
        first = hi if found is None else int(found)
        for rows, steps_blob, times_blob in conn.execute(self._chunk_times, window):
            steps = decode_steps(bytes(steps_blob))
            times = times_array(decode_times(bytes(times_blob), rows))
            young = (steps >= lo) & (steps < first) & ~(times < cutoff)
            if young.any():
                first = int(steps[young][0])
            if int(steps[0]) >= first:
                break
        return first

    def _drop(self, conn: Connection, key: dict[str, int], raw_from: int, cut: int, n_layers: int) -> RetentionPass:
        """Delete the rank's raw rows and chunk rows before ``cut`` (those before ``raw_from`` are gone already);
        re-encode a chunk that straddles it. First store the base blocks of those steps left unstored for their few
        samples, which reads and parent blocks took from the raw points."""
        nids = [int(nid) for (nid,) in conn.execute(self._metrics, {"run_id": key["run_id"]})]
        self._rollups.store_base_blocks(conn, key["run_id"], key["rank"], nids, raw_from, cut - 1, n_layers)
        params = {**key, "cut": cut}
        rows, size = conn.execute(self._raw_size, params).one()
        rows, points = int(rows), int(size) // 4
        conn.execute(self._raw_delete, params)
        for (header,) in conn.execute(self._whole_chunks, params):
            chunk_rows, layers = values_shape(bytes(header))
            rows += chunk_rows
            points += chunk_rows * layers
        conn.execute(self._whole_delete, params)
        for nid, first, count, steps, times, vals in conn.execute(self._straddling, params).all():
            chunk = decode_chunk(int(count), steps, times, vals, None, n_layers)
            behind = int(np.count_nonzero(chunk.steps < cut))
            rows += behind
            points += behind * values_shape(bytes(vals))[1]
            conn.execute(self._chunk_delete, {**key, "nid": int(nid), "first": int(first)})
            kept = chunk.take(np.flatnonzero(chunk.steps >= cut))
            conn.execute(insert(PointChunk), {**key, "name_id": int(nid), **chunk_row(kept)})
        return RetentionPass(1, rows, points)
