"""A comparison against chosen rows of a matrix without gathering them: ``comparison_fields(x, q[rows])`` in one
native pass that reads the rows where they are (``qw_compare_rows`` in ``native.cpp``), for the estimates of
``shadow_rows``, which compare a reference of the kept rows with those rows of a layer's output or weight gradient;
the stratified draw of those rows from uniforms (``qw_stratified_rows``); the kept rows' reference weight gradient
(``qw_weight_grad_rows``); and the two comparisons of an ``nn.Linear`` call on kept rows made in one pass with their
FP32 references (``qw_compare_linear_rows``: the output, ``qw_compare_weight_grad_rows``: the weight gradient).  The
bindings live here, not in `native`'s table.

Where the rows are whole vectors of the build (a row length that is a multiple of 16 floats, 8 on an AVX2 build) the
pass takes every vector, run and sum that ``qw_stats`` takes over the gathered copy, so the figures are those of
``comparison_fields(x, q.index_select(0, rows))`` bit for bit (tests/kernels/test_row_stats.py); anything else is
declined (None) and the caller gathers.  The pass writes the fields itself, weighted, into a statistics row
(`HostRow`) when given one: no Python between the sums and the row.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from array import array
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import native
from .stats import HostRow

__all__ = [
    "RowsBuffer",
    "RowsPass",
    "compare_linear_rows",
    "compare_weight_grad_rows",
    "comparison_into",
    "row_comparison_fields",
    "scratch_matrix",
    "stratified_rows",
    "weight_grad_rows",
]

_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGUMENTS = {
    "qw_compare": [_PTR, _PTR, _I64, ctypes.c_double, _INT, _PTR, _INT],
    "qw_compare_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_double, _INT, _PTR, _INT],
    "qw_stratified_rows": [_PTR, _I64, _I64, _I64, _I64, _PTR],
    "qw_weight_grad_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _INT],
    "qw_compare_linear_rows": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_double, _PTR, _INT],
    "qw_compare_weight_grad_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_double, _PTR, _PTR, _INT],
}
_FIELD_COUNT = 11
_bound: tuple[ctypes.CDLL, dict[str, Any]] | None = None


def _functions(lib: ctypes.CDLL) -> dict[str, Any]:
    """The functions of ``_ARGUMENTS`` in the loaded library by name, typed once."""
    global _bound
    if _bound is None or _bound[0] is not lib:
        functions = {}
        for name, argtypes in _ARGUMENTS.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = _INT, argtypes
            functions[name] = function
        _bound = (lib, functions)
    return _bound[1]


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
    compare = _functions(lib)["qw_compare_rows"]
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
    compare = _functions(lib)["qw_compare"]
    return bool(compare(x.data_ptr(), q.data_ptr(), n, weight, error, out.address, native.threads_for(n)) == 0)


class RowsBuffer(NamedTuple):
    """Where `stratified_rows` can write the rows of two draws of ``k`` and ``k2`` rows: one int64 tensor of ``k +
    k2`` (its first element at ``address``) and its two views, made once (a tensor and two views cost more than the
    draw), None for a draw of none."""

    first: Tensor | None
    second: Tensor | None
    address: int

    @classmethod
    def empty(cls, k: int, k2: int) -> RowsBuffer:
        """A buffer for draws of ``k`` and ``k2`` rows (its values unset)."""
        rows = torch.empty(k + k2, dtype=torch.int64)
        return cls(rows[:k] if k else None, rows[k:] if k2 else None, rows.data_ptr())


def stratified_rows(
    uniforms: np.ndarray,
    start: int,
    address: int,
    draws: tuple[int, int, int, int],
    out: RowsBuffer | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The rows two stratified draws keep, ``draws = (n, k, n2, k2)``: ``k`` of ``n`` (one of each of ``k`` strata,
    quantwatch.agent.rows) from the float64 uniforms ``uniforms[start:start + k]``, then ``k2`` of ``n2`` from the
    next ``k2`` (``address``: that of ``uniforms``' first element), as CPU int64 tensors (None for a draw of none):
    one native call where the library is loaded, written into ``out`` (a buffer for ``k`` and ``k2`` rows, whose
    views are returned) when given; NumPy's operations otherwise (the same rows, in tensors of their own)."""
    n, k, n2, k2 = draws
    lib = native.loaded()
    if lib is not None:
        buffer = RowsBuffer.empty(k, k2) if out is None else out
        if _functions(lib)["qw_stratified_rows"](address + 8 * start, n, k, n2, k2, buffer.address) == 0:
            return buffer.first, buffer.second
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
    gradient = _functions(lib)["qw_weight_grad_rows"]
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


def compare_linear_rows(
    x: Tensor, w: Tensor, bias: Tensor | None, rows: Tensor, y: Tensor, out: HostRow, *, weight: float = 1.0
) -> bool:
    """An ``nn.Linear`` call's output comparison on its kept rows in one native pass (``shadow_rows``): the FP32
    reference ``x[rows] @ w.T + bias`` (each element a float32 dot product over ``x``'s row, summed in the
    build's vector lanes, then the bias) against ``y[rows]``, as `row_comparison_fields` compares them, weighted
    and written into ``out``: True when written.  False (``out`` untouched) when the library is not loaded, for
    tensors it cannot read in place (not contiguous float32 CPU matrices and vectors of matching shapes, ``rows``
    not int64, a subclass), feature counts that are not whole vectors of the build, an index outside ``x``, or where
    the comparison declines (NaN/±inf, sums beyond its float32 runs)."""
    lib = native.loaded()
    if lib is None or x.dim() != 2 or w.dim() != 2 or y.dim() != 2 or rows.dim() != 1:
        return False
    (n, features), (outputs, w_features) = x.shape, w.shape
    if w_features != features or y.shape != (n, outputs) or (bias is not None and bias.shape != (outputs,)):
        return False
    tensors = (x, w, y) if bias is None else (x, w, y, bias)
    if rows.dtype != torch.int64 or any(t.dtype != torch.float32 for t in tensors) or not _readable(*tensors, rows):
        return False
    k = rows.shape[0]
    compare = _functions(lib)["qw_compare_linear_rows"]
    threads = native.threads_for(k * outputs * features)
    bias_address = None if bias is None else bias.data_ptr()
    status = compare(
        x.data_ptr(),
        w.data_ptr(),
        bias_address,
        rows.data_ptr(),
        k,
        n,
        features,
        outputs,
        y.data_ptr(),
        weight,
        out.address,
        threads,
    )
    return bool(status == 0)


class RowsPass(enum.Enum):
    """How `compare_weight_grad_rows` ended."""

    COMPARED = "compared"  # the comparison written into the row (and the reference rows into ``reference``)
    REFERENCE = "reference"  # declined on the values (NaN/±inf, sums beyond its float32 runs): the reference computed
    DECLINED = "declined"  # nothing computed


_ENDED = {0: RowsPass.COMPARED, 1: RowsPass.REFERENCE, 2: RowsPass.REFERENCE}  # OK, NONFINITE, OUT_OF_RANGE


def compare_weight_grad_rows(
    dy: Tensor,
    x: Tensor,
    columns: Tensor,
    grad: Tensor,
    out: HostRow,
    *,
    weight: float = 1.0,
    reference: Tensor | None = None,
) -> RowsPass:
    """An ``nn.Linear`` update comparison on its weight gradient's kept rows ``columns`` in one native pass: the
    reference of `weight_grad_rows` against ``grad[columns]`` as `row_comparison_fields` compares them, weighted
    and written into ``out`` (the figures of the two calls, bit for bit): ``COMPARED`` when written. With
    ``reference`` (a contiguous float32 CPU matrix of ``columns``' count by ``x``'s features) the pass writes the
    reference rows there, also when the comparison declines on the values (``REFERENCE``: compare them another way,
    without computing them again). ``DECLINED`` (``out`` and ``reference`` untouched) where `weight_grad_rows`
    declines, or ``grad`` is not a contiguous float32 CPU matrix of ``dy``'s columns by ``x``'s, or ``reference``
    not as above. ``out`` is untouched unless ``COMPARED``."""
    lib = native.loaded()
    if lib is None or dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or columns.dim() != 1:
        return RowsPass.DECLINED
    (tokens, outputs), features, k = dy.shape, x.shape[1], columns.shape[0]
    if grad.shape != (outputs, features) or columns.dtype != torch.int64:
        return RowsPass.DECLINED
    if not (dy.dtype == x.dtype == grad.dtype == torch.float32 and _readable(dy, x, grad, columns)):
        return RowsPass.DECLINED
    if reference is not None and (
        reference.shape != (k, features) or reference.dtype != torch.float32 or not _readable(reference)
    ):
        return RowsPass.DECLINED
    compare = _functions(lib)["qw_compare_weight_grad_rows"]
    threads = native.threads_for(k * features * tokens)
    status = compare(
        dy.data_ptr(),
        x.data_ptr(),
        columns.data_ptr(),
        tokens,
        outputs,
        features,
        k,
        grad.data_ptr(),
        weight,
        out.address,
        None if reference is None else reference.data_ptr(),
        threads,
    )
    return _ENDED.get(status, RowsPass.DECLINED)


def scratch_matrix(rows: int, columns: int) -> Tensor:
    """A float32 matrix of ``rows`` by ``columns`` for the calling thread to write into, its values unset: the same
    memory every call (grown when too small, one view kept per shape), for values used before the thread's next
    call (a reference the caller compares at once), so that no pass allocates its own."""
    local = _SCRATCH.__dict__
    views: dict[tuple[int, int], Tensor] = local.setdefault("views", {})
    view = views.get((rows, columns))
    if view is None:
        memory: Tensor | None = local.get("memory")
        if memory is None or memory.numel() < rows * columns:
            memory = local["memory"] = torch.empty(rows * columns)
            views.clear()
        view = views[(rows, columns)] = memory[: rows * columns].view(rows, columns)
    return view


_SCRATCH = threading.local()
