"""Folding raw points into chunks, behind the ingest path (issue 21).

With the collector's ``fold_chunks`` setting on (the default since migration 0015), the compactor, once it has moved a
rank's frontier, folds in the same transaction the raw rows behind the frontier into ``point_chunks`` and deletes them:
a crash before the commit leaves the raw rows as they were, after it only the chunks, so nothing is lost or held twice.
A metric's rows are folded once at least :data:`CHUNK_ROWS` of them wait after its last chunk (fewer compress worse: a
chunk's first row has no predecessor to take the difference from); a raw row at or before its last chunk's last step (a
late or re-sent step, written after the chunk) is folded at once into the chunk whose steps span it, replacing that
chunk's row of the same step, or into a chunk of its own in the gap between two.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import Connection, bindparam, delete, func, insert, select, update

from quantwatch.service.models import Point, PointChunk
from quantwatch.service.store.chunk_codec import encode_steps, encode_times, encode_values
from quantwatch.service.store.raw_points import RawPoints, Rows, decode_chunk, merge

CHUNK_ROWS = 64
"""Raw rows of a metric that wait behind the frontier before they are folded (bench/storage_layout.py)."""

_KEY = (
    PointChunk.run_id == bindparam("run_id"),
    PointChunk.rank == bindparam("rank"),
    PointChunk.name_id == bindparam("nid"),
)


def chunk_row(rows: Rows) -> dict[str, object]:
    """The columns of a chunk holding ``rows`` (with times)."""
    times = rows.times if rows.times is not None else np.full(rows.steps.size, np.nan)
    return {
        "first_step": int(rows.steps[0]),
        "last_step": int(rows.steps[-1]),
        "rows": int(rows.steps.size),
        "steps": encode_steps(rows.steps),
        "times": encode_times([None if np.isnan(t) else t for t in times.tolist()]),
        "vals": encode_values(rows.values),
    }


class ChunkFolder:
    """Folds a rank's raw rows behind its frontier into chunks (statements built once)."""

    def __init__(self, points: RawPoints) -> None:
        self.points = points
        rank_key = (Point.run_id == bindparam("run_id"), Point.rank == bindparam("rank"))
        # Per metric with rows behind the frontier: how many, the first, and the last step of its last chunk, in one
        # round trip (compaction runs this every 64 steps, mostly to find nothing due).
        last_chunk = (
            select(PointChunk.last_step)
            .where(
                PointChunk.run_id == bindparam("run_id"),
                PointChunk.rank == bindparam("rank"),
                PointChunk.name_id == Point.name_id,
            )
            .order_by(PointChunk.first_step.desc())
            .limit(1)
            .correlate(Point)
            .scalar_subquery()
        )
        self._waiting = (
            select(Point.name_id, func.count(), func.min(Point.step), last_chunk)
            .where(*rank_key, Point.step < bindparam("frontier"))
            .group_by(Point.name_id)
        )
        self._spans = (
            select(PointChunk.first_step, PointChunk.last_step)
            .where(*_KEY, PointChunk.last_step >= bindparam("lo"), PointChunk.first_step <= bindparam("hi"))
            .order_by(PointChunk.first_step)
        )
        self._chunk = select(PointChunk.rows, PointChunk.steps, PointChunk.times, PointChunk.vals).where(
            *_KEY, PointChunk.first_step == bindparam("first")
        )
        # A chunk's steps stay within its span (rows merged in lie inside it), so its key stays.
        # An UPDATE reserves its table's column names as parameter names: its key parameters are named apart.
        self._update = (
            update(PointChunk)
            .where(
                PointChunk.run_id == bindparam("chunk_run_id"),
                PointChunk.rank == bindparam("chunk_rank"),
                PointChunk.name_id == bindparam("nid"),
                PointChunk.first_step == bindparam("first"),
            )
            .values({c: bindparam(f"new_{c}") for c in ("last_step", "rows", "steps", "times", "vals")})
        )
        self._delete = delete(Point).where(*rank_key, Point.name_id == bindparam("nid"), Point.step <= bindparam("hi"))

    def fold(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        frontier: int,
        n_layers: int,
        fresh: dict[int, Rows] | None = None,
        fresh_from: int = 0,
    ) -> None:
        """Fold what is due of (run, rank)'s raw rows behind ``frontier`` in ``conn``'s transaction. ``fresh``: the
        raw rows (with times) of every metric from ``fresh_from``, the rank's frontier before, up to ``frontier``, as
        the compactor just read them: a metric with no other row waiting is folded from them without reading again."""
        rank_key = {"run_id": run_id, "rank": rank}
        for nid, count, first, last in conn.execute(self._waiting, {**rank_key, "frontier": frontier}).all():
            key = {**rank_key, "nid": int(nid)}
            rows = None if fresh is None else fresh.get(int(nid))
            if rows is not None and int(first) >= fresh_from and int(count) == rows.steps.size:
                # Chunks hold only steps before the old frontier, so none of these rows is late.
                if rows.steps.size >= CHUNK_ROWS:
                    self._insert(conn, key, rows, frontier)
                continue
            late = last is not None and int(first) <= int(last)
            if int(count) >= CHUNK_ROWS or late:
                self._fold_series(conn, key, frontier, n_layers, None if last is None else int(last))

    def _fold_series(
        self, conn: Connection, key: dict[str, int], frontier: int, n_layers: int, last: int | None
    ) -> None:
        # A frontier at ``lo``: the raw rows only (the chunks they fold into are merged below).
        raw = self.points.read(conn, key, 0, frontier - 1, 0, n_layers, times=True)
        cut = -1 if last is None else last
        tail = raw.take(np.flatnonzero(raw.steps > cut))
        late = raw.take(np.flatnonzero(raw.steps <= cut))
        if late.steps.size:
            self._fold_late(conn, key, late)
        if tail.steps.size >= CHUNK_ROWS:
            self._insert(conn, key, tail, frontier)
        elif cut >= 0:
            conn.execute(self._delete, {**key, "hi": cut})

    def _insert(self, conn: Connection, key: dict[str, int], tail: Rows, frontier: int) -> None:
        """Fold ``tail``, every raw row of the series behind ``frontier`` after its last chunk (if any), into chunks
        of at least CHUNK_ROWS rows; delete the raw rows behind the frontier."""
        pieces = np.array_split(np.arange(tail.steps.size), tail.steps.size // CHUNK_ROWS)
        conn.execute(insert(PointChunk), [{**self._row_key(key), **chunk_row(tail.take(p))} for p in pieces])
        conn.execute(self._delete, {**key, "hi": frontier - 1})

    @staticmethod
    def _row_key(key: dict[str, int]) -> dict[str, int]:
        return {"run_id": key["run_id"], "rank": key["rank"], "name_id": key["nid"]}

    def _fold_late(self, conn: Connection, key: dict[str, int], late: Rows) -> None:
        """Fold raw rows at or before the series' last chunk: each into the chunk spanning it, or a chunk of its own
        per gap between chunks."""
        lo, hi = int(late.steps[0]), int(late.steps[-1])
        spans = conn.execute(self._spans, {**key, "lo": lo, "hi": hi}).all()
        firsts = np.array([int(s[0]) for s in spans], dtype=np.int64)
        lasts = np.array([int(s[1]) for s in spans], dtype=np.int64)
        # The last chunk starting at or before each row (-1: before every chunk of the span) and whether it spans it.
        at = np.searchsorted(firsts, late.steps, side="right") - 1
        inside = (at >= 0) & (late.steps <= lasts[np.maximum(at, 0)]) if spans else np.zeros(late.steps.size, bool)
        for i in np.unique(at[inside]).tolist():
            first = int(firsts[i])
            rows, steps, times, vals = conn.execute(self._chunk, {**key, "first": first}).one()
            stored = decode_chunk(int(rows), steps, times, vals, None, late.values.shape[1])
            merged = merge([stored, late.take(np.flatnonzero(inside & (at == i)))])
            new = {f"new_{c}": v for c, v in chunk_row(merged).items() if c != "first_step"}
            where = {"chunk_run_id": key["run_id"], "chunk_rank": key["rank"], "nid": key["nid"], "first": first}
            conn.execute(self._update, {**where, **new})
        gaps = ~inside
        if gaps.any():
            groups = np.unique(at[gaps])
            conn.execute(
                insert(PointChunk),
                [{**self._row_key(key), **chunk_row(late.take(np.flatnonzero(gaps & (at == g))))} for g in groups],
            )
