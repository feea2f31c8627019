"""Quantization error statistics as mergeable partial sums kept on the tensor's device.

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
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.nn.functional import pad

from .formats import FormatSpec, resolve_format

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
        ratio = torch.sqrt(self.sum_err2 / torch.where(self.sum_x2 > 0, self.sum_x2, 1.0))
        degenerate = torch.where(self.sum_err2 > 0, torch.inf, 0.0).to(torch.float64)
        return _nan_if_any(torch.where(self.sum_x2 > 0, ratio, degenerate), self.sum_x2, self.sum_err2)

    @property
    def cosine(self) -> Tensor:
        """⟨q, x⟩ / (‖q‖₂‖x‖₂), clamped to [−1, 1] (1 when both norms are zero, 0 when exactly one is)."""
        denominator = torch.sqrt(self.sum_q2 * self.sum_x2)
        value = (self.sum_qx / torch.where(denominator > 0, denominator, 1.0)).clamp(-1.0, 1.0)
        both_zero = (self.sum_q2 == 0) & (self.sum_x2 == 0)
        degenerate = torch.where(both_zero, 1.0, 0.0).to(torch.float64)
        return _nan_if_any(torch.where(denominator > 0, value, degenerate), self.sum_qx, self.sum_q2, self.sum_x2)

    @property
    def sqnr_db(self) -> Tensor:
        """20·log10(‖x‖₂ / ‖x − q‖₂) in dB (+inf when q equals x, −inf when x is zero and q is not)."""
        value = 10.0 * torch.log10(
            torch.where(self.sum_x2 > 0, self.sum_x2, 1.0) / torch.where(self.sum_err2 > 0, self.sum_err2, 1.0)
        )
        value = torch.where(self.sum_x2 > 0, value, -torch.inf)
        return _nan_if_any(torch.where(self.sum_err2 > 0, value, torch.inf), self.sum_x2, self.sum_err2)

    @property
    def max_abs(self) -> Tensor:
        """The largest absolute error max|q − x| (alias of ``max_abs_err``)."""
        return self.max_abs_err

    @property
    def underflow_ratio(self) -> Tensor:
        """Share of non-zero finite inputs that quantized to zero."""
        return self.underflow_count / torch.where(self.nonzero_count > 0, self.nonzero_count, 1.0)

    @property
    def overflow_ratio(self) -> Tensor:
        """Share of finite inputs clipped at (or overflowing past) the format's maximum."""
        finite = self.numel - self.nonfinite_count
        return self.overflow_count / torch.where(finite > 0, finite, 1.0)

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


def _nan_if_any(value: Tensor, *sums: Tensor) -> Tensor:
    """``value``, or NaN where any of ``sums`` is NaN (the degenerate cases would otherwise read a NaN as zero)."""
    nan = torch.isnan(sums[0])
    for extra in sums[1:]:
        nan = nan | torch.isnan(extra)
    return torch.where(nan, torch.nan, value)


def _check_pair(x: Tensor, q: Tensor) -> None:
    for name, t in (("x", x), ("q", q)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.shape != q.shape:
        raise ValueError(f"q must have the shape of x: {tuple(q.shape)} != {tuple(x.shape)}")


def stats_from_masks(
    x: Tensor,
    q: Tensor,
    overflow_mask: Tensor | None,
    underflow_mask: Tensor | None = None,
    *,
    nonzero_mask: Tensor | None = None,
    amax: Tensor | None = None,
) -> ErrorStats:
    """Statistics of ``q`` against ``x`` given which finite inputs were clipped (``None``: only non-finite ``q``).

    What the quantizer already computed saves passes over the data: ``underflow_mask`` marks the finite non-zero
    ``x`` whose ``q`` is 0 (exactly the underflows counted here), ``nonzero_mask`` the finite non-zero ``x``, and
    ``amax`` is the largest finite ``|x|`` (exactly: float32 holds it for every input but float64). Each is found
    from ``x`` and ``q`` when not given.

    On the CPU the sums are taken in float32 over chunks of 256 to 2048 elements, and the chunks' partial sums added
    in float64 (float64 inputs stay float64 throughout): within 1e-6 relative of float64 sums
    (tests/kernels/test_stats.py bounds it on adversarial inputs) without float64 copies of the tensors. That holds
    when ``x``, ``q`` and ``q − x`` are finite, at most 2^40 in magnitude, and each of ``Σx²``, ``Σq²``, ``Σ(q−x)²``
    is zero by construction or at least ``numel · 2^-100`` (float32 squares then neither overflow a chunk's sum nor
    lose more than 2^-50 of a sum to underflow); otherwise, and on other devices (where checking would wait for the
    device), the masked float64 computation runs.
    """
    if x.numel() == 0:
        return ErrorStats.zeros(x.device)
    if x.device.type == "cpu":
        fast = _chunked_stats(x, q, overflow_mask, underflow_mask, nonzero_mask, amax)
        if fast is not None:
            return fast
    return _masked_stats(x, q, overflow_mask, underflow_mask)


# Chunks are summed in float32: at most 2048 elements, so a chunk's rounding error stays near 1e-7 of its sum; at
# least 256 (when a power of two of that size divides the length; otherwise the tensors are zero-padded), so the
# float64 pass over the partial sums reads at most 1/256 of the data.
_CHUNK = 2048
_MIN_CHUNK = 256
_MAX_MAGNITUDE = 2.0**40
_MIN_SUM_PER_ELEMENT = 2.0**-100


def _chunked_stats(
    x: Tensor,
    q: Tensor,
    overflow_mask: Tensor | None,
    underflow_mask: Tensor | None,
    nonzero_mask: Tensor | None,
    amax: Tensor | None,
) -> ErrorStats | None:
    # Every torch call costs microseconds of dispatch (as much as a pass over a small tensor), so this makes as few
    # as it can: the results are read to the host as they come (this is the CPU path: nothing waits for a device),
    # checked there, and packed in one tensor. None sends the caller to the masked computation.
    f64 = torch.float64
    work = f64 if f64 in (x.dtype, q.dtype) else torch.float32
    with torch.no_grad():
        rows_x, rows_q = _rows(x, work), _rows(q, work)
        rows_err = rows_q - rows_x
        err_min, err_max = torch.aminmax(rows_err)
        err_norms = torch.linalg.vector_norm(rows_err, dim=1)
        # Σx², Σq² and Σqx come from the same products and sums, so q == ±x gives a cosine of exactly ±1.
        partials = torch.stack(
            [
                torch.linalg.vecdot(rows_x, rows_x),
                torch.linalg.vecdot(rows_q, rows_q),
                torch.linalg.vecdot(rows_q, rows_x),
                err_norms.square(),
            ]
        )
        x2, q2, qx, err2 = partials.sum(1, dtype=f64).tolist()
        max_err = max(-err_min.item(), err_max.item())
        if amax is not None:
            x_amax = amax.item()
        else:
            x_min, x_max = torch.aminmax(rows_x)
            x_amax = max(-x_min.item(), x_max.item())
        least = x.numel() * _MIN_SUM_PER_ELEMENT
        in_range = (
            max_err <= _MAX_MAGNITUDE  # False for NaN: q − x is NaN or ±inf wherever x or q is not finite
            and x_amax <= _MAX_MAGNITUDE
            and (x2 >= least or x_amax == 0)
            and (err2 >= least or max_err == 0)
            and (q2 >= least or max_err == x_amax == 0)  # q == x + (q − x)
        )
        if not in_range:
            return None
        underflow = underflow_mask if underflow_mask is not None else (x != 0) & (q == 0)
        nonzero = torch.count_nonzero(x if nonzero_mask is None else nonzero_mask).item()
        underflows = torch.count_nonzero(underflow).item()
        overflows = torch.count_nonzero(overflow_mask).item() if overflow_mask is not None else 0
    fields = (x.numel(), x2, q2, qx, err2, max_err, x_amax, nonzero, underflows, overflows, 0)
    # array → tensor shares the buffer: microseconds less than torch.tensor(list).
    return ErrorStats(*torch.frombuffer(array("d", fields), dtype=f64).unbind())


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` as rows of `_MIN_CHUNK` to `_CHUNK` elements (a view when it can be, else zero-padded)."""
    n = t.numel()
    if n <= _CHUNK:
        rows = t.reshape(1, n)
    elif n & -n >= _MIN_CHUNK:  # the largest power of two dividing n
        rows = t.reshape(-1, min(n & -n, _CHUNK))
    else:
        rows = pad(t.reshape(-1), (0, -n % _CHUNK)).view(-1, _CHUNK)
    return rows if rows.dtype == dtype else rows.to(dtype)


def _masked_stats(
    x: Tensor, q: Tensor, overflow_mask: Tensor | None, underflow_mask: Tensor | None = None
) -> ErrorStats:
    finite_x = torch.isfinite(x)
    finite_q = torch.isfinite(q)
    valid = finite_x & finite_q
    xv = torch.where(valid, x, 0).to(torch.float64)
    qv = torch.where(valid, q, 0).to(torch.float64)
    err = qv - xv
    nonzero = finite_x & (x != 0)
    overflow = finite_x & ~finite_q
    if overflow_mask is not None:
        overflow = overflow | (finite_x & overflow_mask)
    f64 = torch.float64
    return ErrorStats(
        numel=torch.tensor(float(x.numel()), dtype=f64, device=x.device),
        sum_x2=(xv * xv).sum(),
        sum_q2=(qv * qv).sum(),
        sum_qx=(qv * xv).sum(),
        sum_err2=(err * err).sum(),
        max_abs_err=err.abs().amax(),
        amax=torch.where(finite_x, x, 0).abs().amax().to(f64),
        nonzero_count=nonzero.sum(dtype=f64),
        underflow_count=(nonzero & (q == 0) if underflow_mask is None else underflow_mask).sum(dtype=f64),
        overflow_count=overflow.sum(dtype=f64),
        nonfinite_count=(~finite_x).sum(dtype=f64),
    )


def error_stats(x: Tensor, q: Tensor, fmt: str | FormatSpec | None = None) -> ErrorStats:
    """Error statistics of a quantized tensor ``q`` against its original ``x`` (same shape, floating point).

    ``fmt`` names the format of a plain (unscaled) cast: inputs with ``|x|`` above its maximum count as overflows.
    Without it only finite inputs whose ``q`` is not finite count. For scaled quantizations use
    ``quantize(..., with_stats=True)``, which knows the scales. Raises ``TypeError`` for non-tensors or non-float
    dtypes and ``ValueError`` for mismatched shapes or an unknown format.
    """
    _check_pair(x, q)
    overflow_mask = None
    if fmt is not None:
        spec, _ = resolve_format(fmt)
        overflow_mask = x.abs() > spec.max_value
    return stats_from_masks(x, q, overflow_mask)
