"""The comparison of a layer's figure with its reference (output deviation, update direction, weight drift), as
mergeable partial sums."""

from __future__ import annotations

import torch
from torch import Tensor

from quantwatch.kernels import ErrorStats, StatsBatch
from quantwatch.kernels.row_stats import comparison_into, row_comparison_fields
from quantwatch.kernels.stats import HostRow, comparison_fields, host_row

__all__ = ["comparison_stats", "row_comparison_stats"]


def comparison_stats(
    reference: Tensor, value: Tensor, *, error: bool = True, batch: StatsBatch | None = None, weight: float = 1.0
) -> ErrorStats:
    """Partial sums comparing ``value`` with ``reference`` (output deviation, update direction, weight drift).

    Only the four sums the comparison metrics need (Σx², Σq², Σqx, Σ(q−x)²), as float32 dot products accumulated to
    float64: several times cheaper than :func:`~quantwatch.kernels.error_stats`, whose counts (underflow, overflow,
    non-finite) mean nothing for a comparison.  ``max_abs_err`` and ``amax`` are NaN (not computed), and so is
    ``Σ(q−x)²`` with ``error=False`` (for a cosine only, which then needs no ``q − x`` pass); the counts are 0.
    Non-finite values make the sums NaN, which the metrics then report as ``"nan"``.  On the CPU the sums are read
    to the host at once (``batch`` then holds them in a row it prepared, with no torch call).  ``weight`` scales the
    count and the sums: ``n/k`` for a comparison of ``k`` rows kept of ``n`` (an estimate of the full sums)."""
    if reference.numel() == 0:
        return ErrorStats.zeros(reference.device)
    if reference.is_cpu and value.is_cpu:
        # One native pass writes the weighted fields into the statistics' row where it can.
        reference, value = _read_in_place(reference, value)
        row = host_row(batch)
        if comparison_into(reference, value, row, error=error, weight=weight):
            return row.stats
        return _host_stats(comparison_fields(reference, value, error=error), row, weight)
    x = reference.detach()
    q = value.detach()
    x = x.reshape(-1).float()
    q = q.reshape(-1).float()
    dots = [torch.dot(x, x), torch.dot(q, q), torch.dot(q, x)]
    if error:
        err = q - x
        dots.append(torch.dot(err, err))
    sums = torch.stack(dots).double()
    if weight != 1.0:
        sums = sums * weight
    zero = sums.new_zeros(())
    nan = torch.full((), float("nan"), dtype=torch.float64, device=sums.device)
    return ErrorStats(
        numel=torch.full((), float(x.numel()) * weight, dtype=torch.float64, device=sums.device),
        sum_x2=sums[0],
        sum_q2=sums[1],
        sum_qx=sums[2],
        sum_err2=sums[3] if error else nan,
        max_abs_err=nan,
        amax=nan,
        nonzero_count=zero,
        underflow_count=zero,
        overflow_count=zero,
        nonfinite_count=zero,
    )


def row_comparison_stats(
    reference: Tensor, value: Tensor, rows: Tensor, *, batch: StatsBatch | None = None, weight: float = 1.0
) -> ErrorStats:
    """``comparison_stats(reference, value.index_select(0, rows), ...)``: ``reference`` of the rows ``rows`` (kept by
    ``shadow_rows``) of the matrix ``value``.  On the CPU one native pass reads the rows in place (no copy, the same
    figures bit for bit: `quantwatch.kernels.row_stats`) where it can; the rows are gathered otherwise."""
    if reference.numel() and reference.is_cpu:
        # The pass writes the weighted fields into the statistics' row itself.
        row = host_row(batch)
        if row_comparison_fields(reference, value, rows, weight=weight, out=row) is not None:
            return row.stats
        if value.is_cpu:
            return _host_stats(comparison_fields(reference, value.index_select(0, rows)), row, weight)
    return comparison_stats(reference, value.index_select(0, rows), batch=batch, weight=weight)


def _read_in_place(x: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and ``q`` as the native pass reads them in place: as they are when both are contiguous; their transposes
    when both are transposed matrices (the same elements, summed in another order); otherwise with a contiguous copy
    of the one that is not. A weight gradient torchao computes as ``(Xᵀ dY)ᵀ`` (INT8 mixed-precision training) is
    such a transposed view: compared as it was, it took the NumPy way, whose flattening copies it anyway and then
    takes five passes (~6 ms a step of the bench's 16 layers, against ~1 for the copy and the one pass)."""
    if x.is_contiguous() and q.is_contiguous():
        return x, q
    if x.dim() == q.dim() == 2 and x.mT.is_contiguous() and q.mT.is_contiguous():
        return x.mT, q.mT
    return x.contiguous(), q.contiguous()


def _host_stats(fields: tuple[float, ...], row: HostRow, weight: float) -> ErrorStats:
    """``row``'s statistics holding a comparison's host ``fields``, the count and the sums scaled by ``weight``."""
    if weight != 1.0:
        fields = (*(v * weight for v in fields[:5]), *fields[5:])
    row.values[:] = fields
    return row.stats
