"""A comparison against chosen rows of a matrix without gathering them: ``comparison_fields(x, q[rows])`` in one
native pass that reads the rows where they are (``qw_stats_rows`` in ``native.cpp``), for the estimates of
``shadow_rows``, which compare a reference of the kept rows with those rows of a layer's output or weight gradient.

Where the rows are whole vectors of the build (a row length that is a multiple of 16 floats, 8 on an AVX2 build) the
pass takes every vector, run and sum that ``qw_stats`` takes over the gathered copy, so the figures are those of
``comparison_fields(x, q.index_select(0, rows))`` bit for bit (tests/kernels/test_row_stats.py); anything else is
declined (None) and the caller gathers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .partial_sums import pass_buffer, pass_fields
from .stats import comparison_of

__all__ = ["row_comparison_fields"]


def row_comparison_fields(x: Tensor, q: Tensor, rows: Tensor, *, error: bool = True) -> tuple[float, ...] | None:
    """``comparison_fields(x, q.index_select(0, rows), error=error)`` without the copy, bit for bit, from the loaded
    library; None when it is not loaded, for tensors it cannot read in place (not contiguous float32 CPU matrices of
    one row length, ``rows`` not a contiguous int64 vector of ``x``'s row count, a subclass), a row length that is not
    whole vectors, an index outside ``q``, or where the pass declines (NaN/±inf, sums beyond its float32 runs)."""
    lib = native.loaded()
    if lib is None or x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1] or rows.shape != (x.shape[0],):
        return None
    if not (x.dtype == q.dtype == torch.float32 and rows.dtype == torch.int64):
        return None
    tensors = (x, q, rows)
    if not all(t.device.type == "cpu" and t.is_contiguous() and native.plain(t) for t in tensors):
        return None
    partial = pass_buffer()
    count, row = x.shape
    n = x.numel()
    threads = native.threads_for(n)
    status = lib.qw_stats_rows(
        x.data_ptr(), q.data_ptr(), rows.data_ptr(), count, row, q.shape[0], partial.buffer_info()[0], threads
    )
    fields = pass_fields(partial, n) if status == 0 else None
    return comparison_of(fields, error) if fields is not None else None
