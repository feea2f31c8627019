"""Quantization error statistics of CPU and device tensors: `stats_from_masks`, `error_stats`, `StatsBatch`.

`ErrorStats` (the partial sums and the figures derived from them) lives in `partial_sums`; this module computes them
for quantizations done elsewhere (the reference, `QuantLinear`, the agent's comparisons): one native pass when the
kernels are loaded, BLAS dot products otherwise, the masked float64 computation where neither holds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import native
from .formats import FormatSpec, resolve_format
from .partial_sums import ErrorStats, RowStats, lane_sums_in_range, masked_float64

__all__ = [
    "ErrorStats",
    "FlushResult",
    "HostRow",
    "StatsBatch",
    "comparison_fields",
    "comparison_of",
    "error_stats",
    "host_row",
    "stats_from_masks",
]


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

    On the CPU the sums are dot products of rows of 512 elements in float32 (BLAS, no temporaries), and the rows'
    partial sums added in float64 (float64 inputs stay float64 throughout): within 1e-6 relative of float64 sums
    (tests/kernels/test_stats.py bounds it on adversarial inputs) without float64 copies of the tensors. That holds
    when ``x``, ``q`` and ``q − x`` are finite, at most 2^40 in magnitude, and each of ``Σx²``, ``Σq²``, ``Σ(q−x)²``
    is zero by construction or at least ``numel · 2^-100`` (float32 squares then neither overflow a chunk's sum nor
    lose more than 2^-50 of a sum to underflow); otherwise, and on other devices (where checking would wait for the
    device), the masked float64 computation runs. Inside `StatsBatch.collecting` CPU statistics are deferred to the
    batch's `StatsBatch.flush`.
    """
    if x.numel() == 0:
        return ErrorStats.zeros(x.device)
    if x.device.type == "cpu":
        batch: StatsBatch | None = getattr(_COLLECTING, "batch", None)
        # Inference tensors keep no version counter, so nothing could tell whether they changed before a flush.
        if batch is not None and not (x.is_inference() or q.is_inference()):
            return batch._defer(x, q, overflow_mask, underflow_mask, nonzero_mask, amax)
        fast = _chunked_stats(x, q, overflow_mask, underflow_mask, nonzero_mask, amax)
        if fast is not None:
            return fast
    return _masked_stats(x, q, overflow_mask, underflow_mask)


_COLLECTING = threading.local()
# The arguments of `stats_from_masks` after the check: x, q, overflow, underflow and non-zero masks, amax.
_StatsArgs = tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]


class StatsBatch:
    """Statistics of many CPU quantizations, computed together in `flush` instead of one by one as they happen.

    Spread over a training step, each statistics call runs between unrelated work, with cold caches, and costs about
    twice what the same calls cost back to back. While `collecting` is active in a thread, `stats_from_masks` (so
    the reference backend's ``with_stats=True`` and `QuantLinear`'s observed quantizations) of CPU tensors returns
    `ErrorStats` whose fields hold NaN until `flush` fills them in place, and the batch keeps the tensors until
    then. Statistics of other devices, and of inference tensors (which keep no version counter), are computed at
    once as before. `flush` has to run before the tensors change: one changed in place since (its version counter
    moved, as an optimizer step moves a weight's) gets NaN statistics and counts in what `flush` returns.
    """

    def __init__(self) -> None:
        self._pending: list[_Deferred] = []
        self._scope = _Collecting(self)
        # Rows for the statistics handed out until the next flush, made at the last flush (with warm caches): taking
        # one then costs no torch call. As many as were taken between two flushes at most (the first period makes
        # its own).
        self._blank: list[HostRow] = []
        self._taken = 0
        self._wanted = 0

    def __len__(self) -> int:
        """How many statistics wait for `flush`."""
        return len(self._pending)

    def collecting(self) -> _Collecting:
        """A context manager (reentrant, per thread) inside which CPU statistics are deferred to this batch."""
        return self._scope

    def host_stats(self, fields: Sequence[float]) -> ErrorStats:
        """`ErrorStats` (CPU tensors) holding ``fields``, host values in the order of `ErrorStats.FIELDS`."""
        row = self._row()
        row.values[:] = fields
        return row.stats

    def host_row(self) -> HostRow:
        """A row for statistics that a native pass writes in place (at `HostRow.address`), NaN until it does."""
        return self._row()

    def flush(self) -> FlushResult:
        """Compute every pending statistic. Those whose tensors changed in place since (``stale``) or whose
        computation failed (``failed``, the first error kept in ``error``) stay NaN; one never costs another's."""
        pending, self._pending = self._pending, []
        result = FlushResult()
        for entry in pending:
            try:
                filled = entry.fill()
            except Exception as exc:
                result.failed += 1
                result.error = result.error or exc
                continue
            if not filled:
                result.stale += 1
        self._wanted = max(self._wanted, self._taken)
        self._taken = 0
        missing = self._wanted - len(self._blank)
        if missing > 0:
            self._blank.extend(_blank_rows(missing))
        return result

    def _row(self) -> HostRow:
        self._taken += 1
        try:
            return self._blank.pop()  # one call: two threads forwarding through one model cannot both take the last
        except IndexError:
            return _blank_rows(1)[0]

    def _defer(self, *args: *_StatsArgs) -> ErrorStats:
        row = self._row()
        self._pending.append(_Deferred(args, row))
        return row.stats


@dataclass
class FlushResult:
    """What `StatsBatch.flush` left unfilled: statistics of tensors changed in place since, and failed ones."""

    stale: int = 0
    failed: int = 0
    error: Exception | None = None


class HostRow(NamedTuple):
    """Statistics whose fields are views of one float64 row (``values``, the row as NumPy; ``address``, that of its
    first field, for a native pass to write), NaN until set."""

    stats: ErrorStats
    values: np.ndarray
    address: int


def _blank_rows(count: int) -> list[HostRow]:
    block = torch.full((count, len(ErrorStats.FIELDS)), torch.nan, dtype=torch.float64)
    values = block.numpy()
    first, stride = block.data_ptr(), block.stride(0) * block.element_size()
    return [HostRow(RowStats(row), values[i], first + i * stride) for i, row in enumerate(block.unbind())]


def host_row(batch: StatsBatch | None = None) -> HostRow:
    """A row of ``batch``'s (`StatsBatch.host_row`), or with no batch a row of statistics of its own; NaN until set."""
    return _blank_rows(1)[0] if batch is None else batch.host_row()


class _Collecting:
    """`StatsBatch.collecting`: sets the thread's collecting batch, restores the previous one on exit."""

    def __init__(self, batch: StatsBatch) -> None:
        self._batch = batch

    def __enter__(self) -> None:
        saved: list[StatsBatch | None] | None = getattr(_COLLECTING, "saved", None)
        if saved is None:
            saved = _COLLECTING.saved = []
        saved.append(getattr(_COLLECTING, "batch", None))
        _COLLECTING.batch = self._batch

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _COLLECTING.batch = _COLLECTING.saved.pop()


class _Deferred:
    """One deferred `stats_from_masks` call: its arguments (in `_host_fields` order), the versions of ``x`` and
    ``q`` when it was made, and the row its `ErrorStats` views."""

    __slots__ = ("args", "row", "versions")

    def __init__(self, args: _StatsArgs, row: HostRow) -> None:
        self.args, self.row = args, row
        self.versions = (args[0]._version, args[1]._version)

    def fill(self) -> bool:
        """Write the statistics into the row; False (the row stays NaN) when ``x`` or ``q`` changed since."""
        x, q, overflow_mask, underflow_mask = self.args[:4]
        if (x._version, q._version) != self.versions:
            return False
        with torch.no_grad():  # a weight or an activation that requires grad, read for its values only
            fields = _host_fields(*self.args)
            if fields is None:  # outside the chunked range: the exact float64 computation
                self.row.values[:] = _masked_stats(x, q, overflow_mask, underflow_mask).as_tensor().numpy()
            else:
                self.row.values[:] = fields
        return True


# On the CPU the sums are taken with NumPy (BLAS dot products, no temporaries): over rows of `_CHUNK` elements in
# the working dtype, the rows' partial sums then added in float64. Few, cheap calls: a small tensor is bound by the
# fixed cost of each call, not by its passes.
_CHUNK = 512


def _chunked_stats(*args: *_StatsArgs) -> ErrorStats | None:
    fields = _host_fields(*args)
    if fields is None:
        return None
    return RowStats.of(fields)


def _host_fields(
    x: Tensor,
    q: Tensor,
    overflow_mask: Tensor | None,
    underflow_mask: Tensor | None,
    nonzero_mask: Tensor | None,
    amax: Tensor | None,
) -> tuple[float, ...] | None:
    """The fields of `ErrorStats` (in its order) of CPU tensors as Python floats; None outside the chunked range or
    for a tensor subclass.

    Float32 tensors take one pass of the native kernels when an earlier call loaded them (`native.loaded`), their
    float32 runs holding the same 1e-6 (tests/kernels/test_native.py); NumPy's passes otherwise.
    """
    if not (native.plain(x) and native.plain(q)):
        return None  # a subclass's values reach NumPy through torch's ops only: the torch path below this one
    if _native_applies(x, q, overflow_mask, native.loaded() is not None):
        fields = native.stats_fields(x, q, overflow_mask)
        if fields is not None:
            return fields
    work = torch.float64 if torch.float64 in (x.dtype, q.dtype) else torch.float32
    xn, qn = _host_array(x, work), _host_array(q, work)
    n = xn.size
    with np.errstate(all="ignore"):  # non-finite values are found below, from the results
        err = qn - xn
        max_err = max(-float(err.min()), float(err.max()))
        x2, q2, qx, err2 = _dot_sums(((xn, xn), (qn, qn), (qn, xn), (err, err)), n)
    x_amax = amax.item() if amax is not None else max(-float(xn.min()), float(xn.max()))
    in_range = lane_sums_in_range((float(n), x2, q2, qx, err2, max_err, x_amax))
    if not in_range:
        return None
    nonzero = np.count_nonzero(xn if nonzero_mask is None else nonzero_mask.numpy())
    if underflow_mask is None:
        underflows = np.count_nonzero((xn != 0) & (qn == 0))
    else:
        underflows = np.count_nonzero(underflow_mask.numpy())
    overflows = np.count_nonzero(overflow_mask.numpy()) if overflow_mask is not None else 0
    return (float(n), x2, q2, qx, err2, max_err, x_amax, float(nonzero), float(underflows), float(overflows), 0.0)


def _native_applies(x: Tensor, q: Tensor, overflow_mask: Tensor | None, loaded: bool) -> bool:
    return (
        loaded
        and x.dtype == q.dtype == torch.float32
        and x.is_contiguous()
        and q.is_contiguous()
        and (overflow_mask is None or (overflow_mask.dtype == torch.bool and overflow_mask.is_contiguous()))
    )


def _host_array(t: Tensor, dtype: torch.dtype) -> np.ndarray:
    """``t`` flattened, in ``dtype``, as a NumPy array (a view when it can be), in as few torch calls as it can."""
    if t.dtype != dtype:
        t = t.detach().to(dtype)
    elif t.requires_grad:
        t = t.detach()
    return t.numpy().ravel()


def comparison_fields(x: Tensor, q: Tensor, *, error: bool = True) -> tuple[float, ...]:
    """The `ErrorStats` fields (host values, in the order of ``FIELDS``) comparing CPU tensors ``q`` and ``x``: the
    four sums only — one native pass, or one BLAS dot product each over the whole tensor (float32 unless either is
    float64) — no masking.

    ``Σ(q−x)²`` is NaN ("not computed") with ``error=False``, ``max_abs_err`` and ``amax`` are NaN, the counts 0;
    non-finite values make the sums NaN."""
    # Few calls: the agent compares 32 tensors per step between passes that leave its code and data cold, where each
    # call costs several times what it costs in a loop. Float32 tensors take one pass of the native kernels when an
    # earlier call loaded them (every sum, in float32 runs added in float64); four or five NumPy passes otherwise.
    if _native_applies(x, q, None, native.loaded() is not None):
        fields = native.stats_fields(x, q, None)
        if fields is not None:
            return comparison_of(fields, error)
    work = torch.float64 if torch.float64 in (x.dtype, q.dtype) else torch.float32
    xn, qn = _host_array(x, work), _host_array(q, work)
    x2, q2, qx = float(np.vdot(xn, xn)), float(np.vdot(qn, qn)), float(np.vdot(qn, xn))
    err2 = math.nan
    if error:
        if math.isfinite(x2) and math.isfinite(q2):
            err = qn - xn  # |x|, |q| < sqrt(max): q − x cannot overflow, and nothing warns
            err2 = float(np.vdot(err, err))
        else:
            with np.errstate(all="ignore"):
                err = qn - xn
                err2 = float(np.vdot(err, err))
    return (float(xn.size), x2, q2, qx, err2, math.nan, math.nan, 0.0, 0.0, 0.0, 0.0)


def comparison_of(fields: Sequence[float], error: bool) -> tuple[float, ...]:
    """A native statistics pass's fields as a comparison's (`comparison_fields`): the count and the four sums
    (``Σ(q−x)²`` NaN without ``error``), ``max_abs_err`` and ``amax`` NaN, the counts 0."""
    numel, x2, q2, qx, err2 = fields[:5]
    return (numel, x2, q2, qx, err2 if error else math.nan, math.nan, math.nan, 0.0, 0.0, 0.0, 0.0)


def _dot_sums(pairs: tuple[tuple[np.ndarray, np.ndarray], ...], n: int) -> list[float]:
    """``Σ a·b`` of each pair of length-``n`` arrays: dot products of `_CHUNK`-element rows (and of the shorter rest)
    in the arrays' dtype, added in float64. ``a·a`` and ``b·b`` of ``b == ±a`` take the same products in the same
    order as ``a·b``, so ``q == ±x`` gives a cosine of exactly ±1."""
    rows = n - n % _CHUNK
    sums = [0.0] * len(pairs)
    if rows:
        partials = np.stack(
            [np.matmul(a[:rows].reshape(-1, 1, _CHUNK), b[:rows].reshape(-1, _CHUNK, 1)) for a, b in pairs]
        )
        sums = partials.reshape(len(pairs), -1).sum(axis=1, dtype=np.float64).tolist()
    if rows < n:
        sums = [s + float(np.dot(a[rows:], b[rows:])) for s, (a, b) in zip(sums, pairs, strict=True)]
    return sums


def _masked_stats(
    x: Tensor, q: Tensor, overflow_mask: Tensor | None, underflow_mask: Tensor | None = None
) -> ErrorStats:
    finite_x, finite_q, xv, qv, err = masked_float64(x, q)
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
