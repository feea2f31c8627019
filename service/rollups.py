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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

MISSING_BITS = 0x7FC00001
NAN_BITS = 0x7FC00000
# Rollup block sizes in steps (powers of four so a read combines at most four blocks of the level below a width).
LEVELS: tuple[int, ...] = (64, 256, 1024, 4096)


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
    if all(len(blob) == width for blob in blobs):
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
    def from_blobs(cls, rows: Sequence[tuple[bytes, bytes, bytes, bytes]], n_layers: int) -> Partials:
        """Decode stored rollup rows (vmin, vmax, vsum, vcount blobs), padding older, narrower rows."""
        out = cls.empty(len(rows), n_layers)
        if not rows:
            return out
        if all(len(r[3]) == 2 * n_layers for r in rows):
            # Read-only views on the joined bytes (no copies): every operation on Partials makes new arrays.
            return cls(
                np.frombuffer(b"".join(r[0] for r in rows), "<f4").reshape(-1, n_layers),
                np.frombuffer(b"".join(r[1] for r in rows), "<f4").reshape(-1, n_layers),
                np.frombuffer(b"".join(r[2] for r in rows), "<f8").reshape(-1, n_layers),
                np.frombuffer(b"".join(r[3] for r in rows), "<u2").reshape(-1, n_layers).astype(np.int64),
            )
        for i, (bmin, bmax, bsum, bcount) in enumerate(rows):
            width = len(bcount) // 2
            out.vmin[i, :width] = np.frombuffer(bmin, "<f4")
            out.vmax[i, :width] = np.frombuffer(bmax, "<f4")
            out.vsum[i, :width] = np.frombuffer(bsum, "<f8")
            out.vcount[i, :width] = np.frombuffer(bcount, "<u2")
        return out

    def blobs(self, row: int) -> tuple[bytes, bytes, bytes, bytes]:
        """Encode one row for storage (counts as uint16: a block never holds more than 4096 steps)."""
        return (
            self.vmin[row].astype("<f4").tobytes(),
            self.vmax[row].astype("<f4").tobytes(),
            self.vsum[row].astype("<f8").tobytes(),
            self.vcount[row].astype("<u2").tobytes(),
        )

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
        if starts.size <= 4096:
            # ufunc.reduceat along axis 0 of a 2-D array is several times slower than reducing each group's
            # contiguous block of rows (numpy walks it column by column).
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
        sl = slice(layer, layer + 1)
        return Partials(self.vmin[:, sl], self.vmax[:, sl], self.vsum[:, sl], self.vcount[:, sl])

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


def to_json_floats(values: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_] | None = None) -> list[object]:
    """Floats for JSON: non-finite values as the wire strings ``"nan"``, ``"inf"``, ``"-inf"``; invalid as None."""
    out: list[object] = values.astype(np.float64).tolist()
    bad = ~np.isfinite(values)
    if valid is not None:
        bad |= ~valid
    for i in np.flatnonzero(bad).tolist():
        if valid is not None and not valid[i]:
            out[i] = None
        else:
            v = float(values[i])
            out[i] = "nan" if v != v else ("inf" if v > 0 else "-inf")
    return out


def to_json_matrix(values: npt.NDArray[np.floating], valid: npt.NDArray[np.bool_]) -> list[list[object]]:
    """:func:`to_json_floats` for a 2-D array, row by row, fixing up only the non-finite or invalid cells."""
    out: list[list[object]] = values.astype(np.float64).tolist()
    for i, j in np.argwhere(~valid | ~np.isfinite(values)).tolist():
        if not valid[i, j]:
            out[i][j] = None
        else:
            v = float(values[i, j])
            out[i][j] = "nan" if v != v else ("inf" if v > 0 else "-inf")
    return out
