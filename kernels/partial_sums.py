"""Error statistics as mergeable partial sums (`ErrorStats`), and the range in which float32 runs of them hold.

Every field is a 0-dim float64 tensor, so computing, combining and shipping statistics never waits for the device.
Ratios and norms are derived from the sums on demand (ARCHITECTURE.md, "Formulas"):

* ``rel_l2 = sqrt(Σ(q−x)² / Σx²)``: 0 when both sums are zero, +inf when only ``Σx²`` is;
* ``cosine = Σqx / sqrt(Σq² · Σx²)``: 1 when both norms are zero, 0 when exactly one is;
* ``sqnr_db = 10·log10(Σx² / Σ(q−x)²)`` (= 20·log10 of the norm ratio): +inf when ``q == x``, −inf when ``x`` is zero
  and ``q`` is not;
* ``underflow_ratio = underflow_count / nonzero_count`` and ``overflow_ratio = overflow_count / finite inputs``: 0 when
  the denominator is 0.

Which elements count: inputs that are NaN or ±inf are counted in ``nonfinite_count`` and left out of every sum and
maximum; a finite input whose quantized value is not finite (non-saturating overflow) counts as an overflow and is
left out of the sums. So an empty tensor gives ``numel == 0``, sums 0, ``rel_l2 == 0``, ``cosine == 1``,
``sqnr_db == +inf`` and ratios 0 — no NaN. Sums that are NaN all the same (comparisons of tensors that hold NaN,
such as the agent's output deviation, sum them unmasked) make ``rel_l2``, ``cosine`` and ``sqnr_db`` NaN rather than
one of the degenerate values above.


A leaf below every backend: the reference's statistics (`stats`), the fused paths and the native kernels all build
their results here, so none of them imports another to do so.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

# How many float64 partial sums a native pass writes (`pass_buffer`).
_PASS_FIELDS = 10
_SUM_FIELDS = (
    "numel",
    "sum_x2",
    "sum_q2",
    "sum_qx",
    "sum_err2",
    "nonzero_count",
    "underflow_count",
    "overflow_count",
    "nonfinite_count",
)
_MAX_FIELDS = ("max_abs_err", "amax")


@dataclass(frozen=True, eq=False)
class ErrorStats:
    """Partial sums of one or more quantizations; see the module docstring for the derived figures.

    ``max_abs_err`` is the largest ``|q − x|`` and ``amax`` the largest finite ``|x|``. Combine statistics of parts
    (micro-batches, shards, ranks) with `combine`; never average derived ratios. Equality is identity (comparing
    device tensors would wait for the device); compare ``to_dict()`` or ``as_tensor()`` instead.
    """

    numel: Tensor
    sum_x2: Tensor
    sum_q2: Tensor
    sum_qx: Tensor
    sum_err2: Tensor
    max_abs_err: Tensor
    amax: Tensor
    nonzero_count: Tensor
    underflow_count: Tensor
    overflow_count: Tensor
    nonfinite_count: Tensor

    FIELDS: ClassVar[tuple[str, ...]] = (
        "numel",
        "sum_x2",
        "sum_q2",
        "sum_qx",
        "sum_err2",
        "max_abs_err",
        "amax",
        "nonzero_count",
        "underflow_count",
        "overflow_count",
        "nonfinite_count",
    )

    @classmethod
    def zeros(cls, device: torch.device | str | None = None) -> ErrorStats:
        """Statistics of an empty tensor: the identity of `combine`."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(**dict.fromkeys(cls.FIELDS, zero))

    def combine(self, other: ErrorStats) -> ErrorStats:
        """Statistics of the union of both measured tensors: sums add, maxima take the larger."""
        if not isinstance(other, ErrorStats):
            raise TypeError(f"other must be ErrorStats, got {type(other).__name__}")
        merged = {name: getattr(self, name) + getattr(other, name) for name in _SUM_FIELDS}
        merged.update({name: torch.maximum(getattr(self, name), getattr(other, name)) for name in _MAX_FIELDS})
        return ErrorStats(**merged)

    def as_tensor(self) -> Tensor:
        """The partial sums as one 1-D float64 tensor in the order of `FIELDS` (for all-reduce or stacking)."""
        return torch.stack([getattr(self, name) for name in self.FIELDS])

    @classmethod
    def from_tensor(cls, t: Tensor) -> ErrorStats:
        """Inverse of `as_tensor`; ``t`` must be 1-D with ``len(FIELDS)`` entries."""
        if not isinstance(t, Tensor):
            raise TypeError(f"t must be a Tensor, got {type(t).__name__}")
        if t.shape != (len(cls.FIELDS),):
            raise ValueError(
                f"t must have shape ({len(cls.FIELDS)},) in the order of ErrorStats.FIELDS, got {tuple(t.shape)}"
            )
        t = t.to(torch.float64)
        return cls(**{name: t[i] for i, name in enumerate(cls.FIELDS)})

    @property
    def rel_l2(self) -> Tensor:
        """‖q − x‖₂ / ‖x‖₂ (0 when both are zero, +inf when only x is)."""
        result: Tensor = rel_l2_of(self.sum_x2, self.sum_err2, TORCH_FIGURES)
        return result

    @property
    def cosine(self) -> Tensor:
        """⟨q, x⟩ / (‖q‖₂‖x‖₂), clamped to [−1, 1] (1 when both norms are zero, 0 when exactly one is)."""
        result: Tensor = cosine_of(self.sum_qx, self.sum_q2, self.sum_x2, TORCH_FIGURES)
        return result

    @property
    def sqnr_db(self) -> Tensor:
        """20·log10(‖x‖₂ / ‖x − q‖₂) in dB (+inf when q equals x, −inf when x is zero and q is not)."""
        result: Tensor = sqnr_db_of(self.sum_x2, self.sum_err2, TORCH_FIGURES)
        return result

    @property
    def max_abs(self) -> Tensor:
        """The largest absolute error max|q − x| (alias of ``max_abs_err``)."""
        return self.max_abs_err

    @property
    def underflow_ratio(self) -> Tensor:
        """Share of non-zero finite inputs that quantized to zero."""
        result: Tensor = underflow_ratio_of(self.underflow_count, self.nonzero_count, TORCH_FIGURES)
        return result

    @property
    def overflow_ratio(self) -> Tensor:
        """Share of finite inputs clipped at (or overflowing past) the format's maximum."""
        result: Tensor = overflow_ratio_of(self.overflow_count, self.numel, self.nonfinite_count, TORCH_FIGURES)
        return result

    def to_dict(self) -> dict[str, float]:
        """Every partial sum and derived figure as Python floats (this waits for the device)."""
        values = torch.cat(
            [
                self.as_tensor(),
                torch.stack(
                    [self.rel_l2, self.cosine, self.sqnr_db, self.max_abs, self.underflow_ratio, self.overflow_ratio]
                ),
            ]
        ).tolist()
        names = [*self.FIELDS, "rel_l2", "cosine", "sqnr_db", "max_abs", "underflow_ratio", "overflow_ratio"]
        return dict(zip(names, values, strict=True))


# The derived figures, written once for torch tensors (`ErrorStats`: on the statistics' device, never waiting for it)
# and NumPy arrays (the agent's exporter thread derives a step's figures of every layer at once, where each torch call
# on a few dozen values costs more than its work). ``Figures`` are either, as the operations given say.
Figures = Any


@dataclass(frozen=True)
class FigureOps:
    """The array operations the derived figures take: ``where(condition, a, b)`` (``a`` and ``b`` arrays or Python
    floats; of two floats a float64 result), ``sqrt``, ``log10``, ``isnan`` and ``clip(values, low, high)``."""

    where: Callable[[Figures, Figures, Figures], Figures]
    sqrt: Callable[[Figures], Figures]
    log10: Callable[[Figures], Figures]
    isnan: Callable[[Figures], Figures]
    clip: Callable[[Figures, float, float], Figures]


def _torch_where(condition: Tensor, a: Tensor | float, b: Tensor | float) -> Tensor:
    chosen = torch.where(condition, a, b)
    # Two Python floats give the default dtype: float64 as NumPy's (inf and 0, 1 convert exactly).
    return chosen if isinstance(a, Tensor) or isinstance(b, Tensor) else chosen.to(torch.float64)


def _by_torch(fn: Callable[[Tensor], Tensor]) -> Callable[[np.ndarray], np.ndarray]:
    """``fn`` applied to a NumPy array by torch: NumPy's ``sqrt`` and ``log10`` round some values other than
    torch's, and the figures are the same bits either way."""

    def apply(values: np.ndarray) -> np.ndarray:
        result: np.ndarray = fn(torch.from_numpy(np.asarray(values))).numpy()
        return result

    return apply


TORCH_FIGURES = FigureOps(_torch_where, torch.sqrt, torch.log10, torch.isnan, torch.clamp)
NUMPY_FIGURES = FigureOps(np.where, _by_torch(torch.sqrt), _by_torch(torch.log10), np.isnan, np.clip)


def rel_l2_of(sum_x2: Figures, sum_err2: Figures, ops: FigureOps) -> Figures:
    """``sqrt(Σ(q−x)² / Σx²)``: 0 when both sums are zero, +inf when only ``Σx²`` is, NaN when either is NaN."""
    ratio = ops.sqrt(sum_err2 / ops.where(sum_x2 > 0, sum_x2, 1.0))
    degenerate = ops.where(sum_err2 > 0, torch.inf, 0.0)
    return _nan_if_any(ops.where(sum_x2 > 0, ratio, degenerate), ops, sum_x2, sum_err2)


def cosine_of(sum_qx: Figures, sum_q2: Figures, sum_x2: Figures, ops: FigureOps) -> Figures:
    """``Σqx / sqrt(Σq² · Σx²)`` clamped to [−1, 1]: 1 when both norms are zero, 0 when exactly one is, NaN when
    any sum is NaN."""
    denominator = ops.sqrt(sum_q2 * sum_x2)
    value = ops.clip(sum_qx / ops.where(denominator > 0, denominator, 1.0), -1.0, 1.0)
    degenerate = ops.where((sum_q2 == 0) & (sum_x2 == 0), 1.0, 0.0)
    return _nan_if_any(ops.where(denominator > 0, value, degenerate), ops, sum_qx, sum_q2, sum_x2)


def sqnr_db_of(sum_x2: Figures, sum_err2: Figures, ops: FigureOps) -> Figures:
    """``10·log10(Σx² / Σ(q−x)²)``: +inf when ``Σ(q−x)²`` is zero, −inf when only ``Σx²`` is, NaN when either is
    NaN."""
    value = 10.0 * ops.log10(ops.where(sum_x2 > 0, sum_x2, 1.0) / ops.where(sum_err2 > 0, sum_err2, 1.0))
    value = ops.where(sum_x2 > 0, value, -torch.inf)
    return _nan_if_any(ops.where(sum_err2 > 0, value, torch.inf), ops, sum_x2, sum_err2)


def underflow_ratio_of(underflow_count: Figures, nonzero_count: Figures, ops: FigureOps) -> Figures:
    """``underflow_count / nonzero_count`` (0 when there is no non-zero input)."""
    return underflow_count / ops.where(nonzero_count > 0, nonzero_count, 1.0)


def overflow_ratio_of(overflow_count: Figures, numel: Figures, nonfinite_count: Figures, ops: FigureOps) -> Figures:
    """``overflow_count`` over the finite inputs (0 when there is none)."""
    finite = numel - nonfinite_count
    return overflow_count / ops.where(finite > 0, finite, 1.0)


def _nan_if_any(value: Figures, ops: FigureOps, *sums: Figures) -> Figures:
    """``value``, or NaN where any of ``sums`` is NaN (the degenerate cases would otherwise read a NaN as zero)."""
    nan = ops.isnan(sums[0])
    for extra in sums[1:]:
        nan = nan | ops.isnan(extra)
    return ops.where(nan, torch.nan, value)


# Fast statistics sum float32 products over short runs and those runs' sums in float64: each run within its length ·
# 2^-24 of its exact value (1e-6 for runs of up to 8 products, or 512 in BLAS dot products), while no float32 product
# overflows or loses much of a sum to underflow, which `lane_sums_in_range` checks on the results.
LANE_MAX_MAGNITUDE = 2.0**40
LANE_MIN_SUM_PER_ELEMENT = 2.0**-100


def lane_sums_in_range(stats: list[float] | tuple[float, ...]) -> bool:
    """Whether float32 runs of products hold 1e-6 for these statistics (a sequence in `ErrorStats.FIELDS` order).

    No product may overflow (|x|, |q − x| ≤ 2^40, so |q| ≤ 2^41 and eight squares stay below 2^85), and each of Σx²,
    Σq², Σ(q−x)² is zero by construction or at least numel · 2^-100, so products lost to float32 underflow (under
    2^-149 each) cost at most 2^-49 of it. NaN and ±inf fail every comparison or the magnitude bound. This also
    excludes the subnormal scales (amax below max · 2^-126) under which a scale taken from the amax could clip.
    """
    numel, sum_x2, sum_q2, _, sum_err2, max_err, amax = stats[:7]
    least = numel * LANE_MIN_SUM_PER_ELEMENT
    return (
        max_err <= LANE_MAX_MAGNITUDE  # False for NaN: q − x is NaN or ±inf wherever x or q is not finite
        and amax <= LANE_MAX_MAGNITUDE
        and (sum_x2 >= least or amax == 0)
        and (sum_err2 >= least or max_err == 0)
        and (sum_q2 >= least or max_err == amax == 0)  # q == x + (q − x)
    )


def pass_buffer() -> array[float]:
    """A zeroed buffer for what a native statistics or scan pass writes (its partial sums; `pass_fields` reads it)."""
    return array("d", bytes(8 * _PASS_FIELDS))


def pass_fields(partial: Sequence[float], numel: int) -> tuple[float, ...] | None:
    """The fields (`ErrorStats.FIELDS` order) of a native statistics pass over ``numel`` elements from the partial
    sums it wrote (``qw_stats``, ``qw_float8_stats``); None when they are beyond the float32 runs' range."""
    sum_x2, sum_q2, sum_qx, sum_err2, max_err, amax, nonzero, underflow, overflow, _ = partial
    fields = (float(numel), sum_x2, sum_q2, sum_qx, sum_err2, max_err, amax, nonzero, underflow, overflow, 0.0)
    return fields if lane_sums_in_range(list(fields)) else None


def masked_float64(x: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(finite_x, finite_q, xv, qv, err)``: the finiteness masks, and x, q and q − x in float64 with every element
    where either is NaN or ±inf zeroed (what the exact, masked statistics sum)."""
    finite_x = torch.isfinite(x)
    finite_q = torch.isfinite(q)
    valid = finite_x & finite_q
    xv = torch.where(valid, x, 0).to(torch.float64)
    qv = torch.where(valid, q, 0).to(torch.float64)
    return finite_x, finite_q, xv, qv, qv - xv


_FIELD_INDEX = {name: i for i, name in enumerate(ErrorStats.FIELDS)}


class RowStats(ErrorStats):
    """`ErrorStats` held in one float64 row: each field's 0-dim view is made when first read (about half a
    microsecond each; the agent reads none, it takes the row whole with `as_tensor`)."""

    def __init__(self, row: Tensor) -> None:  # the fields are views made on demand, not dataclass fields
        object.__setattr__(self, "_row", row)

    @classmethod
    def of(cls, fields: Sequence[float]) -> RowStats:
        """Statistics (a CPU row) holding host values ``fields`` in the order of `ErrorStats.FIELDS`: one torch
        call, where eleven 0-dim tensors cost a dozen."""
        # array → tensor shares the buffer: microseconds less than torch.tensor(list).
        return cls(torch.frombuffer(array("d", fields), dtype=torch.float64))

    def __getattr__(self, name: str) -> Tensor:
        index = _FIELD_INDEX.get(name)
        if index is None:
            raise AttributeError(name)
        value: Tensor = self._row[index]
        object.__setattr__(self, name, value)
        return value

    def as_tensor(self) -> Tensor:
        """The row itself (a view: its values are the statistics)."""
        row: Tensor = self._row
        return row
