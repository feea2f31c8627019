"""Folding raw points into chunks, off the ingest path (issue 21).

With the collector's ``fold_chunks`` setting on (the default), once a compaction has moved a rank's frontier, the
rank's raw rows behind it are folded into ``point_chunks`` by a background thread (:mod:`.fold_worker`) in three
steps: :meth:`ChunkFolder.plan` reads what is due without any write lock, :func:`encode_folds` encodes the chunks with
no transaction open (the encoding is most of a fold's cost), then :meth:`ChunkFolder.apply`, in a short transaction
under the rank's write lock, reads the same raw
rows and chunks again and, only when they are as the plan found them, writes the chunks and deletes the raw rows it
folded. So a batch's transaction never waits for an encoding; a crash before the apply's commit leaves the raw rows
as they were, after it only the chunks, and a raw row re-sent, a fold of another replica or a retention sweep in
between makes the apply leave that series for the next fold: nothing is lost or held twice.

A metric's rows are folded once at least :data:`CHUNK_ROWS` of them wait after its last chunk (fewer compress worse: a
chunk's first row has no predecessor to take the difference from); a raw row at or before its last chunk's last step (a
late or re-sent step, written after the chunk) is folded at once into the chunk whose steps span it, replacing that
chunk's row of the same step, or into a chunk of its own in the gap between two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, delete, func, insert, select, update

from quantwatch.service.models import Point, PointChunk
from quantwatch.service.rollups import rows_from_blobs
from quantwatch.service.store.chunk_codec import encode_steps, encode_times, encode_values
from quantwatch.service.store.raw_points import Rows, decode_chunk, merge, times_array

CHUNK_ROWS = 128
"""Raw rows of a metric that wait behind the frontier before they are folded (bench/storage_layout.py). 128 rather
than 64: the values take 2% fewer bytes (fewer first rows without a predecessor; 1.95 → 1.91 bytes per value on the
demo's series), and a chunk of 512 layers then always outgrows a 64 KiB SQLite page, so its overflow pages are full
and only the remainder shares a leaf page, where one of ~60 KiB took a page of its own: over 4,096 steps of 16-step
batches the second half costs 2.45 → 2.32 bytes per point (demo), 2.44 → 2.22 (agent); the raw tail waiting to be
folded is twice as long."""

_KEY = (
    PointChunk.run_id == bindparam("run_id"),
    PointChunk.rank == bindparam("rank"),
    PointChunk.name_id == bindparam("nid"),
)
_CHUNK_COLUMNS = ("first_step", "last_step", "rows", "steps", "times", "vals")


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


def encode_chunks(parts: list[Rows]) -> list[dict[str, object]]:
    """:func:`chunk_row` of each of ``parts`` (a module-level function: the fold worker may run it in a process of its
    own)."""
    return [chunk_row(rows) for rows in parts]


Encoder = Callable[[list[Rows]], list[dict[str, object]]]


@dataclass(frozen=True)
class Seen:
    """What a fold of one series read: its raw rows at or before ``hi`` (step, vals, time) and its chunks whose steps
    overlap [``lo``, ``hi``] (every column), as the database returned them."""

    raw: list[Any]
    chunks: list[Any]


@dataclass(frozen=True)
class SeriesFold:
    """The writes that fold one series' raw rows at or before ``hi`` (all of them) into chunks, and what they were
    computed from (``seen``, over [``lo``, ``hi``]). ``inserts`` and ``updates`` are the statements' parameters, filled
    in once the rows of ``new_chunks`` and ``merged_chunks`` (the key columns of each, and its rows) are encoded."""

    key: dict[str, int]
    lo: int
    hi: int
    seen: Seen
    new_chunks: list[tuple[dict[str, int], Rows]]
    merged_chunks: list[tuple[dict[str, int], Rows]]
    inserts: list[dict[str, object]] = field(default_factory=list)
    updates: list[dict[str, object]] = field(default_factory=list)

    def encoded(self) -> list[Rows]:
        """The rows to encode, inserts first."""
        return [rows for _, rows in (*self.new_chunks, *self.merged_chunks)]

    def fill(self, chunks: list[dict[str, object]]) -> None:
        """Take the encoded columns of :meth:`encoded`'s rows, in that order."""
        new, merged = chunks[: len(self.new_chunks)], chunks[len(self.new_chunks) :]
        self.inserts.extend({**key, **row} for (key, _), row in zip(self.new_chunks, new, strict=True))
        self.updates.extend(
            {**key, **{f"new_{c}": v for c, v in row.items() if c != "first_step"}}
            for (key, _), row in zip(self.merged_chunks, merged, strict=True)
        )


class ChunkFolder:
    """Plans and applies the folds of a rank's raw rows behind its frontier (statements built once)."""

    def __init__(self) -> None:
        rank_key = (Point.run_id == bindparam("run_id"), Point.rank == bindparam("rank"))
        # Per metric with rows behind the frontier: how many, the first, and the last step of its last chunk, in one
        # round trip.
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
        series = (*rank_key, Point.name_id == bindparam("nid"))
        self._raw = (
            select(Point.step, Point.vals, Point.time)
            .where(*series, Point.step <= bindparam("hi"))
            .order_by(Point.step)
        )
        self._chunks = (
            select(*(getattr(PointChunk, c) for c in _CHUNK_COLUMNS))
            .where(*_KEY, PointChunk.last_step >= bindparam("lo"), PointChunk.first_step <= bindparam("hi"))
            .order_by(PointChunk.first_step)
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
            .values({c: bindparam(f"new_{c}") for c in _CHUNK_COLUMNS[1:]})
        )
        self._delete = delete(Point).where(*series, Point.step <= bindparam("hi"))

    def plan(self, conn: Connection, run_id: int, rank: int, frontier: int, n_layers: int) -> list[SeriesFold]:
        """The folds due of (run, rank)'s raw rows behind ``frontier`` from what ``conn`` reads (no lock needed:
        :meth:`apply` checks it again), to be encoded (:func:`encode_folds`) once ``conn``'s transaction is over."""
        rank_key = {"run_id": run_id, "rank": rank}
        folds = []
        for nid, count, first, last in conn.execute(self._waiting, {**rank_key, "frontier": frontier}).all():
            late = last is not None and int(first) <= int(last)
            if int(count) >= CHUNK_ROWS or late:
                fold = self._plan_series(conn, {**rank_key, "nid": int(nid)}, frontier, n_layers, last)
                if fold is not None:
                    folds.append(fold)
        return folds

    def apply(self, conn: Connection, fold: SeriesFold) -> bool:
        """Write ``fold`` in ``conn``'s transaction (under the rank's write lock) when the series' raw rows and chunks
        it was computed from are unchanged; whether it was written."""
        if self._seen(conn, fold.key, fold.lo, fold.hi) != fold.seen:
            return False
        if fold.updates:
            conn.execute(self._update, fold.updates)
        if fold.inserts:
            conn.execute(insert(PointChunk), fold.inserts)
        conn.execute(self._delete, {**fold.key, "hi": fold.hi})
        return True

    def _seen(self, conn: Connection, key: dict[str, int], lo: int, hi: int) -> Seen:
        return Seen(self._raw_rows(conn, key, hi), self._chunk_rows(conn, key, lo, hi))

    def _raw_rows(self, conn: Connection, key: dict[str, int], hi: int) -> list[Any]:
        return list(conn.execute(self._raw, {**key, "hi": hi}).all())

    def _chunk_rows(self, conn: Connection, key: dict[str, int], lo: int, hi: int) -> list[Any]:
        return list(conn.execute(self._chunks, {**key, "lo": lo, "hi": hi}).all())

    def _plan_series(
        self, conn: Connection, key: dict[str, int], frontier: int, n_layers: int, last: int | None
    ) -> SeriesFold | None:
        cut = -1 if last is None else int(last)
        found = self._raw_rows(conn, key, frontier - 1)
        if not found:
            return None
        raw = Rows(
            np.array([int(r[0]) for r in found], dtype=np.int64),
            rows_from_blobs([bytes(r[1]) for r in found], n_layers),
            times_array([r[2] for r in found]),
        )
        tail = raw.take(np.flatnonzero(raw.steps > cut))
        late = raw.take(np.flatnonzero(raw.steps <= cut))
        folds_tail = tail.steps.size >= CHUNK_ROWS
        if not late.steps.size and not folds_tail:
            return None
        lo, hi = int(raw.steps[0]), frontier - 1 if folds_tail else cut
        # Chunks hold steps up to ``cut`` only: with no late row, none overlaps the raw rows (the usual case).
        chunks = self._chunk_rows(conn, key, lo, hi) if late.steps.size else []
        row_key = {"run_id": key["run_id"], "rank": key["rank"], "name_id": key["nid"]}
        new, merged = self._plan_late(key, row_key, late, chunks, n_layers) if late.steps.size else ([], [])
        if folds_tail:
            pieces = np.array_split(np.arange(tail.steps.size), tail.steps.size // CHUNK_ROWS)
            new.extend((row_key, tail.take(p)) for p in pieces)
        seen = Seen(found[: int(np.searchsorted(raw.steps, hi, side="right"))], chunks)
        return SeriesFold(key, lo, hi, seen, new, merged)

    @staticmethod
    def _plan_late(
        key: dict[str, int],
        row_key: dict[str, int],
        late: Rows,
        chunks: list[Any],
        n_layers: int,
    ) -> tuple[list[tuple[dict[str, int], Rows]], list[tuple[dict[str, int], Rows]]]:
        """New chunks and merged chunks (each with its key columns) that fold raw rows at or before the series' last
        chunk: each into the chunk spanning it, or a chunk of its own per gap between chunks."""
        spans = [c for c in chunks if int(c[1]) >= int(late.steps[0]) and int(c[0]) <= int(late.steps[-1])]
        firsts = np.array([int(c[0]) for c in spans], dtype=np.int64)
        lasts = np.array([int(c[1]) for c in spans], dtype=np.int64)
        # The last chunk starting at or before each row (-1: before every chunk of the span) and whether it spans it.
        at = np.searchsorted(firsts, late.steps, side="right") - 1
        inside = (at >= 0) & (late.steps <= lasts[np.maximum(at, 0)]) if spans else np.zeros(late.steps.size, bool)
        merged = []
        for i in np.unique(at[inside]).tolist():
            first, _, rows, steps, times, vals = spans[i]
            stored = decode_chunk(int(rows), steps, times, vals, None, n_layers)
            where = {"chunk_run_id": key["run_id"], "chunk_rank": key["rank"], "nid": key["nid"], "first": int(first)}
            merged.append((where, merge([stored, late.take(np.flatnonzero(inside & (at == i)))])))
        gaps = ~inside
        new = [
            (row_key, late.take(np.flatnonzero(gaps & (at == g))))
            for g in (np.unique(at[gaps]).tolist() if gaps.any() else [])
        ]
        return new, merged


def encode_folds(folds: list[SeriesFold], encode: Encoder = encode_chunks) -> None:
    """Encode the chunks of ``folds`` (all in one call of ``encode``) into their statements' parameters."""
    chunks = encode([rows for fold in folds for rows in fold.encoded()]) if folds else []
    done = 0
    for fold in folds:
        count = len(fold.encoded())
        fold.fill(chunks[done : done + count])
        done += count
