"""A comparison against chosen rows of a matrix without gathering them: ``comparison_fields(x, q[rows])`` in one
native pass that reads the rows where they are (``qw_compare_rows`` in ``native.cpp``), for the estimates of
``shadow_rows``, which compare a reference of the kept rows with those rows of a layer's output or weight gradient;
and the stratified draw of those rows from uniforms (``qw_stratified_rows``).  The bindings of both live here, not
in `native`'s table.

Where the rows are whole vectors of the build (a row length that is a multiple of 16 floats, 8 on an AVX2 build) the
pass takes every vector, run and sum that ``qw_stats`` takes over the gathered copy, so the figures are those of
``comparison_fields(x, q.index_select(0, rows))`` bit for bit (tests/kernels/test_row_stats.py); anything else is
declined (None) and the caller gathers.  The pass writes the fields itself, weighted, into a statistics row
(`HostRow`) when given one: no Python between the sums and the row.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import native
from .stats import HostRow

__all__ = ["comparison_into", "row_comparison_fields", "stratified_rows", "weight_grad_rows"]

_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGUMENTS = {
    "qw_compare": [_PTR, _PTR, _I64, ctypes.c_double, _INT, _PTR, _INT],
    "qw_compare_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_double, _INT, _PTR, _INT],
    "qw_stratified_rows": [_PTR, _I64, _I64, _I64, _I64, _PTR],
    "qw_weight_grad_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT],
}
_FIELD_COUNT = 11
_bound: tuple[ctypes.CDLL, Any, Any, Any, Any] | None = None


def _functions(lib: ctypes.CDLL) -> tuple[ctypes.CDLL, Any, Any, Any, Any]:
    """``(lib, qw_compare_rows, qw_stratified_rows, qw_weight_grad_rows, qw_compare)`` of the loaded library, typed
    once."""
    global _bound
    if _bound is None or _bound[0] is not lib:
        for name, argtypes in _ARGUMENTS.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = _INT, argtypes
        _bound = (lib, lib.qw_compare_rows, lib.qw_stratified_rows, lib.qw_weight_grad_rows, lib.qw_compare)
    return _bound


def _readable(*tensors: Tensor) -> bool:
    """Whether the kernels can read each of ``tensors`` in place: contiguous plain CPU tensors."""
    return all(t.is_cpu and t.is_contiguous() and native.plain(t) for t in tensors)


def row_comparison_fields(
    x: Tensor, q: Tensor, rows: Tensor, *, error: bool = True, weight: float = 1.0, out: HostRow | None = None
) -> tuple[float, ...] | HostRow | None:
    """``comparison_fields(x, q.index_select(0, rows), error=error)`` without the copy, bit for bit, from the loaded
    library, the count and the sums multiplied by ``weight`` as `quantwatch.agent.comparison` weights them; written
    into ``out`` (then returned) when given, else returned as a tuple.  None when the library is not loaded, for
    tensors it cannot read in place (not contiguous float32 CPU matrices of one row length, ``rows`` not a
    contiguous int64 vector of ``x``'s row count, a subclass), a row length that is not whole vectors, an index
    outside ``q``, or where the pass declines (NaN/±inf, sums beyond its float32 runs); ``out`` is untouched then."""
    lib = native.loaded()
    if lib is None or x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1] or rows.shape != (x.shape[0],):
        return None
    if not (x.dtype == q.dtype == torch.float32 and rows.dtype == torch.int64):
        return None
    if not _readable(x, q, rows):
        return None
    count, row = x.shape
    buffer = array("d", bytes(8 * _FIELD_COUNT))
    address = buffer.buffer_info()[0] if out is None else out.address
    compare = _functions(lib)[1]
    threads = native.threads_for(x.numel())
    if compare(x.data_ptr(), q.data_ptr(), rows.data_ptr(), count, row, q.shape[0], weight, error, address, threads):
        return None
    return tuple(buffer) if out is None else out


def comparison_into(x: Tensor, q: Tensor, out: HostRow, *, error: bool = True, weight: float = 1.0) -> bool:
    """``comparison_fields(x, q, error=error)`` weighted as `row_comparison_fields` weights them, written into
    ``out`` by one native pass: True when written, bit for bit the fields of its native path; False (``out``
    untouched) when the library is not loaded, for tensors it cannot read in place (not contiguous float32 CPU
    tensors of as many elements, a subclass), or where the pass declines (NaN/±inf, sums beyond its float32 runs)."""
    lib = native.loaded()
    n = x.numel()
    if lib is None or q.numel() != n or not (x.dtype == q.dtype == torch.float32 and _readable(x, q)):
        return False
    compare = _functions(lib)[4]
    return bool(compare(x.data_ptr(), q.data_ptr(), n, weight, error, out.address, native.threads_for(n)) == 0)


def stratified_rows(
    uniforms: np.ndarray, start: int, address: int, draws: tuple[int, int, int, int]
) -> tuple[Tensor | None, Tensor | None]:
    """The rows two stratified draws keep, ``draws = (n, k, n2, k2)``: ``k`` of ``n`` (one of each of ``k`` strata,
    quantwatch.agent.rows) from the float64 uniforms ``uniforms[start:start + k]``, then ``k2`` of ``n2`` from the
    next ``k2`` (``address``: that of ``uniforms``' first element), as CPU int64 tensors (None for a draw of none):
    one native call where the library is loaded, NumPy's operations otherwise (the same rows)."""
    n, k, n2, k2 = draws
    lib = native.loaded()
    if lib is not None:
        rows = torch.empty(k + k2, dtype=torch.int64)
        if _functions(lib)[2](address + 8 * start, n, k, n2, k2, rows.data_ptr()) == 0:
            return (rows[:k] if k else None), (rows[k:] if k2 else None)
    return _numpy_rows(uniforms[start : start + k], n, k), _numpy_rows(uniforms[start + k : start + k + k2], n2, k2)


def _numpy_rows(uniforms: np.ndarray, n: int, k: int) -> Tensor | None:
    if not k:
        return None
    bounds = np.arange(k + 1, dtype=np.int64) * n // k
    starts, sizes = bounds[:-1], bounds[1:] - bounds[:-1]
    return torch.from_numpy(starts + np.minimum((uniforms * sizes).astype(np.int64), sizes - 1))


def weight_grad_rows(dy: Tensor, x: Tensor, columns: Tensor) -> Tensor | None:
    """``dy[:, columns].T @ x`` in float32 (an ``nn.Linear``'s weight gradient ``dYᵀX`` for the kept rows
    ``columns`` of it) in one native pass that reads ``dy``'s columns where they are: each element the float32 sum
    over the tokens in their order, the same on any number of threads.  None when the library is not loaded, for
    tensors it cannot read (not contiguous float32 CPU matrices of as many rows, ``columns`` not an int64 vector, a
    subclass), a row length of ``x`` that is not whole vectors of the build, or an index outside ``dy``'s columns."""
    lib = native.loaded()
    if lib is None or dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or columns.dim() != 1:
        return None
    if not (dy.dtype == x.dtype == torch.float32 and columns.dtype == torch.int64 and _readable(dy, x, columns)):
        return None
    (tokens, out_features), in_features, k = dy.shape, x.shape[1], columns.shape[0]
    reference = torch.empty((k, in_features))
    threads = native.threads_for(k * in_features * tokens)
    gradient = _functions(lib)[3]
    if gradient(
        dy.data_ptr(),
        x.data_ptr(),
        columns.data_ptr(),
        tokens,
        out_features,
        in_features,
        k,
        reference.data_ptr(),
        threads,
    ):
        return None
    return reference
