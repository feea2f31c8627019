"""Every read of raw points goes through here: the compactor's chunks (``point_chunks``) merged with the raw rows
(``points``), a raw row winning over a chunk's row of the same step (issue 21).

Chunks hold only steps behind their rank's frontier (``compacted_step``), so under the rank's write lock (ingest, the
compactor) a read that starts at or after the frontier needs no chunk lookup. Without the lock a frontier read a
moment ago may be stale (a compaction may have folded the rows since): such reads pass ``frontier=None`` and always
look the chunks up, after the raw rows, so a fold committing in between leaves a row in one or the other, never in
neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import BindParameter, Connection, Integer, bindparam, func, select

from quantwatch.service.models import Point, PointChunk
from quantwatch.service.rollups import F32, F64, I64, MISSING_BITS, group_starts, rows_from_blobs
from quantwatch.service.store.chunk_codec import decode_steps, decode_times, decode_values
from quantwatch.service.store.common import columns


@dataclass(frozen=True)
class Rows:
    """Raw rows of one series in step order: steps, values (rows × width) and, when asked for, times (NaN: none)."""

    steps: I64
    values: F32
    times: F64 | None = None

    def take(self, index: I64 | slice) -> Rows:
        return Rows(self.steps[index], self.values[index], None if self.times is None else self.times[index])


def fit_width(values: F32, width: int) -> F32:
    """``values`` with ``width`` columns: later layers (added after the rows were written) missing."""
    if values.shape[1] == width:
        return values
    if values.shape[1] > width:
        return np.ascontiguousarray(values[:, :width])
    out = np.full((values.shape[0], width), MISSING_BITS, dtype=np.uint32).view(np.float32)
    out[:, : values.shape[1]] = values
    return out


def merge(parts: list[Rows]) -> Rows:
    """One step-ordered series from ``parts`` (each step-ordered); of rows with the same step the one of the latest
    part wins (callers pass chunks first, raw rows last)."""
    if len(parts) == 1:
        return parts[0]
    steps = np.concatenate([p.steps for p in parts])
    if not steps.size:
        return parts[-1]
    order = np.argsort(steps, kind="stable")
    ordered = steps[order]
    keep = order[np.append(ordered[1:] != ordered[:-1], True)]
    times = None if parts[0].times is None else np.concatenate([p.times for p in parts if p.times is not None])
    return Rows(steps[keep], np.concatenate([p.values for p in parts])[keep], None if times is None else times[keep])


def times_array(times: list[float | None]) -> F64:
    """Row times as float64, NaN where a row has none (a stored time is always finite)."""
    return np.array([np.nan if t is None else t for t in times], dtype=np.float64)


def decode_chunk(rows: int, steps: bytes, times: bytes | None, vals: bytes, layer: int | None, width: int) -> Rows:
    """One chunk's rows (``layer``: that column only; ``times`` None: without times)."""
    values = decode_values(bytes(vals), layer)
    return Rows(
        decode_steps(bytes(steps)),
        values if layer is not None else fit_width(values, width),
        None if times is None else times_array(decode_times(bytes(times), rows)),
    )


class RawPoints:
    """The merged reads of raw points, statements built once."""

    def __init__(self) -> None:
        offset = bindparam("offset", type_=Integer)
        raw = (
            Point.run_id == bindparam("run_id"),
            Point.rank == bindparam("rank"),
            Point.name_id == bindparam("nid"),
            Point.step >= bindparam("lo"),
            Point.step <= bindparam("hi"),
        )
        self._raw = select(Point.step, Point.vals).where(*raw).order_by(Point.step)
        self._raw_timed = select(Point.step, Point.vals, Point.time).where(*raw).order_by(Point.step)
        self._raw_layer = select(Point.step, func.substr(Point.vals, offset, 4)).where(*raw).order_by(Point.step)
        series = (
            PointChunk.run_id == bindparam("run_id"),
            PointChunk.rank == bindparam("rank"),
            PointChunk.name_id == bindparam("nid"),
        )
        # Chunks of a series never overlap: the one holding ``lo`` (if any) is the last starting at or before it, so
        # the index walk starts there instead of at the series' first chunk.
        floor = select(func.max(PointChunk.first_step)).where(*series, PointChunk.first_step <= bindparam("lo"))
        overlapping = (
            *series,
            PointChunk.first_step >= func.coalesce(floor.scalar_subquery(), bindparam("lo")),
            PointChunk.first_step <= bindparam("hi"),
            PointChunk.last_step >= bindparam("lo"),
        )
        self._chunks = (
            select(PointChunk.rows, PointChunk.steps, PointChunk.vals)
            .where(*overlapping)
            .order_by(PointChunk.first_step)
        )
        self._chunks_timed = (
            select(PointChunk.rows, PointChunk.steps, PointChunk.vals, PointChunk.times)
            .where(*overlapping)
            .order_by(PointChunk.first_step)
        )
        self._chunk_steps = select(PointChunk.steps).where(*overlapping).order_by(PointChunk.first_step)
        self._next_raw = select(Point.step).where(*raw[:4]).order_by(Point.step).limit(1)
        self._next_chunk = (
            select(PointChunk.steps)
            .where(*overlapping[:2], PointChunk.last_step >= bindparam("lo"))
            .order_by(PointChunk.first_step)
            .limit(1)
        )
        tail = (*raw[:2], Point.step >= bindparam("lo"), Point.step < bindparam("hi"))
        self._rank_tail = select(Point.name_id, Point.step, Point.vals).where(*tail).order_by(Point.name_id, Point.step)
        # Several series of a rank at once (read_many): their chunks from the earliest of their floors (each series'
        # own, as in ``floor`` above, computed per name id): a series whose floor is later scans a few more index
        # entries, which ``last_step >= lo`` drops.
        nids: BindParameter[int] = bindparam("nids", type_=Integer, expanding=True)
        of_rank = (PointChunk.run_id == bindparam("run_id"), PointChunk.rank == bindparam("rank"))
        floors = (
            select(func.max(PointChunk.first_step).label("first"))
            .where(*of_rank, PointChunk.name_id.in_(nids), PointChunk.first_step <= bindparam("lo"))
            .group_by(PointChunk.name_id)
            .subquery()
        )
        earliest = select(func.min(floors.c.first)).scalar_subquery()
        self._many_raw = (
            select(Point.name_id, Point.step, Point.vals)
            .where(*raw[:2], Point.name_id.in_(nids), *raw[3:])
            .order_by(Point.name_id, Point.step)
        )
        self._many_chunks = (
            select(PointChunk.name_id, PointChunk.rows, PointChunk.steps, PointChunk.vals)
            .where(
                *of_rank,
                PointChunk.name_id.in_(nids),
                PointChunk.first_step >= func.coalesce(earliest, bindparam("lo")),
                PointChunk.first_step <= bindparam("hi"),
                PointChunk.last_step >= bindparam("lo"),
            )
            .order_by(PointChunk.name_id, PointChunk.first_step)
        )
        self._raw_steps = select(Point.step).where(*raw).order_by(Point.step).limit(bindparam("limit", type_=Integer))

    def read(
        self,
        conn: Connection,
        key: dict[str, int],
        lo: int,
        hi: int,
        frontier: int | None,
        width: int,
        *,
        layer: int | None = None,
        times: bool = False,
    ) -> Rows:
        """Rows of the series ``key`` (run_id, rank, nid) with lo <= step <= hi: every layer (``width`` of them), or
        only ``layer`` (one column); with ``times``, their times too. ``frontier``: the rank's, read under its write
        lock, or None (see the module)."""
        params = {**key, "lo": lo, "hi": hi}
        if layer is not None:
            rows = conn.execute(self._raw_layer, {**params, "offset": 4 * layer + 1}).all()
            steps, blobs = columns(rows)
            raw = Rows(steps, rows_from_blobs(blobs, 1))
        elif times:
            rows = conn.execute(self._raw_timed, params).all()
            steps, blobs = columns(rows)
            raw = Rows(steps, rows_from_blobs(blobs, width), times_array([r[2] for r in rows]))
        else:
            steps, blobs = columns(conn.execute(self._raw, params).all())
            raw = Rows(steps, rows_from_blobs(blobs, width))
        if frontier is not None and lo >= frontier:
            return raw
        statement = self._chunks_timed if times else self._chunks
        parts = [
            _inside(decode_chunk(found[0], found[1], found[3] if times else None, found[2], layer, width), lo, hi)
            for found in conn.execute(statement, params)
        ]
        return merge([*parts, raw]) if parts else raw

    def read_many(
        self, conn: Connection, run_id: int, rank: int, nids: Sequence[int], lo: int, hi: int, width: int
    ) -> dict[int, Rows]:
        """Rows of each series ``nids`` of (run, rank) with lo <= step <= hi, every layer, without times: what
        :meth:`read` answers for each with ``frontier=None``, in two statements for them all (raw rows first, then
        chunks, as :meth:`read` reads them)."""
        params = {"run_id": run_id, "rank": rank, "nids": list(nids), "lo": lo, "hi": hi}
        raw = _by_series(conn.execute(self._many_raw, params).all(), width)
        parts: dict[int, list[Rows]] = {}
        for found in conn.execute(self._many_chunks, params):
            chunk = decode_chunk(found[1], found[2], None, found[3], None, width)
            parts.setdefault(int(found[0]), []).append(_inside(chunk, lo, hi))
        empty = Rows(np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.float32))
        return {nid: merge([*parts.get(nid, []), raw.get(nid, empty)]) for nid in nids}

    def rank_tail(self, conn: Connection, run_id: int, rank: int, lo: int, hi: int, width: int) -> dict[int, Rows]:
        """Every metric's rows of (run, rank) with lo <= step < hi (without their times), by name id, where ``lo``
        is at or past the rank's frontier: raw rows only, as chunks hold none there (the compactor's read of the
        blocks it builds)."""
        return _by_series(
            conn.execute(self._rank_tail, {"run_id": run_id, "rank": rank, "lo": lo, "hi": hi}).all(), width
        )

    def next_step(self, conn: Connection, key: dict[str, int], lo: int) -> int | None:
        """The first step at or after ``lo`` of the series ``key`` (None when there is none)."""
        params = {**key, "lo": lo}
        found = conn.execute(self._next_raw, params).scalar()
        blob = conn.execute(self._next_chunk, params).scalar()
        if blob is not None:
            steps = decode_steps(bytes(blob))
            first = int(steps[np.searchsorted(steps, lo)])
            found = first if found is None else min(int(found), first)
        return None if found is None else int(found)

    def steps(self, conn: Connection, key: dict[str, int], lo: int, hi: int, limit: int) -> I64:
        """The distinct steps of the series ``key`` in [lo, hi], at least the first ``limit`` of them (all when
        fewer): enough to tell whether the range holds more than ``limit`` samples without decoding values."""
        params = {**key, "lo": lo, "hi": hi}
        raw = np.array(conn.execute(self._raw_steps, {**params, "limit": limit}).scalars().all(), dtype=np.int64)
        found = [raw]
        total = raw.size
        for (blob,) in conn.execute(self._chunk_steps, params):
            steps = decode_steps(bytes(blob))
            found.append(steps[(steps >= lo) & (steps <= hi)])
            total += found[-1].size
            if total > 2 * limit:
                break
        return np.unique(np.concatenate(found))


def _inside(chunk: Rows, lo: int, hi: int) -> Rows:
    """The rows of ``chunk`` with lo <= step <= hi."""
    inside = (chunk.steps >= lo) & (chunk.steps <= hi)
    return chunk if inside.all() else chunk.take(np.flatnonzero(inside))


def _by_series(found: Sequence[Any], width: int) -> dict[int, Rows]:
    """(name id, step, blob) rows ordered by name id and step as each name id's Rows (without times)."""
    if not found:
        return {}
    nids = np.fromiter((r[0] for r in found), dtype=np.int64, count=len(found))
    steps = np.fromiter((r[1] for r in found), dtype=np.int64, count=len(found))
    values = rows_from_blobs([bytes(r[2]) for r in found], width)
    keys, starts = group_starts(nids)
    ends = [*starts[1:].tolist(), len(found)]
    return {
        int(nid): Rows(steps[a:b], values[a:b], None)
        for nid, a, b in zip(keys.tolist(), starts.tolist(), ends, strict=True)
    }
