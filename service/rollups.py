"""Vectorised min/max/sum/count partials over step blocks: the numerics behind storage rollups and bucketed reads.

Semantics, shared by ingest rollups and query-time bucketing so both give the same answer:

* a value never measured (``null`` on the wire) is stored as the float32 bit pattern :data:`MISSING_BITS` (a quiet
  NaN with payload 1); incoming NaNs are canonicalised to :data:`NAN_BITS` so the two never mix;
* missing values are left out of every aggregate (``count`` counts measured values);
* non-finite measured values propagate as IEEE arithmetic does: a NaN in a bucket makes its min, max and mean NaN,
  an ``inf`` makes the max and the mean ``inf``;
* means are ``sum / count`` with float64 sums merged exactly from partials — never averages of averages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import orjson

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
JsonFloats = npt.NDArray[np.floating] | list[object]

MISSING_BITS = 0x7FC00001
NAN_BITS = 0x7FC00000
# One layer's rollup record, packed little-endian (18 bytes): how a block was stored before revision 0017, which
# compresses them (rollup_codec); the migrations read and write it.
STATS_DTYPE = np.dtype([("min", "<f4"), ("max", "<f4"), ("sum", "<f8"), ("count", "<u2")])
# Rollup block sizes in steps. A read of bucket width w takes the largest level ≤ w, so combines at most four blocks
# per bucket; 128 is there for the most common read, a 1,000-point series of a 100,000-step run (w = 128), which then
# reads 782 blocks instead of 1,563 level-64 ones (see BENCHMARKS.md, issue 3).
LEVELS: tuple[int, ...] = (64, 128, 256, 1024, 4096)


def missing_row(n_layers: int) -> F32:
    """A float32 row of ``n_layers`` missing values."""
    return np.full(n_layers, MISSING_BITS, dtype=np.uint32).view(np.float32)


def canonicalise(values: F32) -> F32:
    """Return ``values`` with every NaN replaced by the canonical NaN (so no input can look missing)."""
    nan = np.isnan(values)
    if not nan.any():
        return values
    out = values.copy()
    out.view(np.uint32)[nan] = NAN_BITS
    return out


def is_missing(values: F32) -> npt.NDArray[np.bool_]:
    """Mask of the values that were never measured."""
    mask: npt.NDArray[np.bool_] = values.view(np.uint32) == MISSING_BITS
    return mask


def rows_from_blobs(blobs: Sequence[bytes], n_layers: int) -> F32:
    """Stack float32 blobs into ``[len(blobs), n_layers]``; shorter blobs (older layer counts) pad with missing."""
    width = 4 * n_layers
    if set(map(len, blobs)) <= {width}:  # map/set: no Python frame per row (a series decodes ~800)
        return np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(blobs), n_layers).astype(np.float32)
    out = np.empty((len(blobs), n_layers), dtype=np.float32)
    out.view(np.uint32)[:] = MISSING_BITS
    for i, blob in enumerate(blobs):
        row = np.frombuffer(blob, dtype="<f4")[:n_layers]
        out[i, : row.size] = row
    return out


@dataclass
class Partials:
    """Per-(row, layer) aggregates: float32 min/max, float64 sum, int64 count of measured values."""

    vmin: F32
    vmax: F32
    vsum: npt.NDArray[np.floating]  # float64, or float32 straight from raw values (widened by every reduction)
    vcount: npt.NDArray[np.integer]  # int64, or uint8 straight from raw values

    @classmethod
    def from_values(cls, values: F32) -> Partials:
        """One partial per value (rows × layers); missing values become the identity of each aggregate."""
        missing = is_missing(values)
        if not missing.any():
            # The common case: everything measured. Keep float32 sums and uint8 counts; reductions widen them.
            return cls(values, values, values, np.ones(values.shape, dtype=np.uint8))
        with np.errstate(invalid="ignore"):
            vmin = np.where(missing, np.float32(np.inf), values).astype(np.float32)
            vmax = np.where(missing, np.float32(-np.inf), values).astype(np.float32)
            vsum = np.where(missing, 0.0, values.astype(np.float64))
        return cls(vmin, vmax, vsum, (~missing).astype(np.int64))

    @classmethod
    def empty(cls, rows: int, n_layers: int) -> Partials:
        """Identity partials (nothing measured)."""
        shape = (rows, n_layers)
        return cls(
            np.full(shape, np.inf, dtype=np.float32),
            np.full(shape, -np.inf, dtype=np.float32),
            np.zeros(shape, dtype=np.float64),
            np.zeros(shape, dtype=np.int64),
        )

    @classmethod
    def from_stats(cls, blobs: Sequence[bytes], n_layers: int) -> Partials:
        """Decode blocks of :data:`STATS_DTYPE` records (the layout before revision 0017), padding narrower ones."""
        width = STATS_DTYPE.itemsize * n_layers
        if blobs and set(map(len, blobs)) == {width}:
            rec = np.frombuffer(b"".join(blobs), STATS_DTYPE).reshape(-1, n_layers)
        else:
            rec = np.zeros((len(blobs), n_layers), STATS_DTYPE)
            rec["min"], rec["max"] = np.inf, -np.inf
            for i, blob in enumerate(blobs):
                row = np.frombuffer(blob, STATS_DTYPE)
                rec[i, : row.size] = row
        return cls(rec["min"], rec["max"], rec["sum"], rec["count"].astype(np.int64))

    def stats(self, row: int) -> bytes:
        """One row as :data:`STATS_DTYPE` records, the layout before revision 0017 (counts as uint16: a block never
        holds more than 4096 steps)."""
        rec = np.empty(self.vmin.shape[1], STATS_DTYPE)
        rec["min"], rec["max"], rec["sum"], rec["count"] = (
            self.vmin[row],
            self.vmax[row],
            self.vsum[row],
            self.vcount[row],
        )
        return rec.tobytes()

    @classmethod
    def concat(cls, parts: Sequence[Partials]) -> Partials:
        """The rows of ``parts`` one after another (float64 sums, int64 counts)."""
        return cls(
            np.concatenate([p.vmin for p in parts]),
            np.concatenate([p.vmax for p in parts]),
            np.concatenate([p.vsum.astype(np.float64, copy=False) for p in parts]),
            np.concatenate([p.vcount.astype(np.int64, copy=False) for p in parts]),
        )

    @classmethod
    def side_by_side(cls, parts: Sequence[Partials]) -> Partials:
        """The layers of ``parts`` (the same rows in each) one after another: several metrics' partials as one, so
        that a reduction runs once for all of them (:meth:`columns` takes each back)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.hstack([p.vmin for p in parts]),
            np.hstack([p.vmax for p in parts]),
            np.hstack([p.vsum for p in parts]),
            np.hstack([p.vcount for p in parts]),
        )

    def columns(self, start: int, stop: int) -> Partials:
        """Layers ``start`` … ``stop - 1`` of every row (views)."""
        sl = slice(start, stop)
        return Partials(self.vmin[:, sl], self.vmax[:, sl], self.vsum[:, sl], self.vcount[:, sl])

    def merge(self, other: Partials) -> Partials:
        """Element-wise combination of two partials of the same shape."""
        return Partials(
            np.minimum(self.vmin, other.vmin),
            np.maximum(self.vmax, other.vmax),
            self.vsum.astype(np.float64, copy=False) + other.vsum,
            self.vcount.astype(np.int64, copy=False) + other.vcount,
        )

    def reduce(self, starts: I64) -> Partials:
        """Combine consecutive rows: group ``g`` spans rows ``starts[g] … starts[g+1]-1``."""
        rows = self.vcount.shape[0]
        if starts.size == rows:
            return self.widened()  # every group is one row (a read at exactly a rollup level)
        sizes = np.diff(np.append(starts, rows))
        if starts.size > 8 and np.count_nonzero(sizes > 1) * 4 < starts.size:
            # Mostly single-row groups (rollup blocks plus a raw head and tail): reduce only the others.
            out = self.take(starts).widened()
            multi = np.flatnonzero(sizes > 1)
            members = np.concatenate([np.arange(starts[g], starts[g] + sizes[g]) for g in multi.tolist()])
            sub_starts = np.concatenate(([0], np.cumsum(sizes[multi])[:-1])).astype(np.int64)
            reduced = self.take(members).reduce(sub_starts)
            out.vmin[multi] = reduced.vmin
            out.vmax[multi] = reduced.vmax
            out.vsum[multi] = reduced.vsum
            out.vcount[multi] = reduced.vcount
            return out
        if starts.size <= 4096 and self.vmin.shape[1] >= 64:
            # For wide arrays ufunc.reduceat along axis 0 is several times slower than reducing each group's
            # contiguous block of rows (numpy walks it column by column); for one column reduceat wins.
            ends = np.append(starts[1:], rows).tolist()
            groups = list(zip(starts.tolist(), ends, strict=True))
            return Partials(
                np.stack([self.vmin[a:b].min(axis=0) for a, b in groups]),
                np.stack([self.vmax[a:b].max(axis=0) for a, b in groups]),
                np.stack([self.vsum[a:b].sum(axis=0, dtype=np.float64) for a, b in groups]),
                np.stack([self.vcount[a:b].sum(axis=0, dtype=np.int64) for a, b in groups]),
            )
        return Partials(
            np.minimum.reduceat(self.vmin, starts, axis=0),
            np.maximum.reduceat(self.vmax, starts, axis=0),
            np.add.reduceat(self.vsum, starts, axis=0, dtype=np.float64),
            np.add.reduceat(self.vcount, starts, axis=0, dtype=np.int64),
        )

    def widened(self) -> Partials:
        """The same partials with float64 sums and int64 counts (no copy when they already are)."""
        return Partials(
            self.vmin, self.vmax, self.vsum.astype(np.float64, copy=False), self.vcount.astype(np.int64, copy=False)
        )

    def take(self, rows: I64 | slice) -> Partials:
        """A subset of rows."""
        return Partials(self.vmin[rows], self.vmax[rows], self.vsum[rows], self.vcount[rows])

    def column(self, layer: int) -> Partials:
        """One layer as a ``[rows, 1]`` partial."""
        return self.columns(layer, layer + 1)

    def mean(self) -> F64:
        """``sum / count`` (NaN where nothing was measured; callers mask with ``vcount``)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean: F64 = self.vsum.astype(np.float64, copy=False) / np.maximum(self.vcount, 1)
            return mean


def group_starts(keys: I64) -> tuple[I64, I64]:
    """For sorted ``keys``: the distinct keys and the index where each run of equal keys starts."""
    if keys.size == 0:
        return keys, keys
    starts = np.concatenate(([0], np.flatnonzero(np.diff(keys)) + 1)).astype(np.int64)
    return keys[starts], starts


def json_float(value: float) -> float | str:
    """A float for JSON: itself when finite, else the wire string ``"nan"``, ``"inf"`` or ``"-inf"``."""
    if math.isfinite(value):
        return value
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


def to_json_floats(values: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_] | None = None) -> JsonFloats:
    """Floats for JSON (see :func:`dumps`): the array itself when every value is valid and finite, else a list with
    the wire strings ``"nan"``, ``"inf"``, ``"-inf"`` for non-finite values and None for invalid ones."""
    bad = ~np.isfinite(values)
    if valid is not None:
        bad |= ~valid
    if not bad.any():
        return np.ascontiguousarray(values)
    out: list[object] = list(values)
    for i in np.flatnonzero(bad).tolist():
        if valid is not None and not valid[i]:
            out[i] = None
        else:
            out[i] = json_float(float(values[i]))
    return out


def to_json_matrix(values: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_]) -> list[JsonFloats]:
    """:func:`to_json_floats` row by row."""
    return [to_json_floats(values[i], valid[i]) for i in range(values.shape[0])]


def dumps(content: object) -> bytes:
    """JSON bytes with numpy arrays and scalars written natively; float32 values get their shortest float32 text
    (which reads back to the identical float32), float64 values their shortest float64 text."""
    return orjson.dumps(content, default=_contiguous, option=orjson.OPT_SERIALIZE_NUMPY)


def _contiguous(value: object) -> object:
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
