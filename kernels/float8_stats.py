"""The error statistics of a float8 cast in one native pass over its bytes and its high-precision input.

Measuring a cast such as torchao's (``_data``: the float8 values, ``_scale``: what the input was multiplied by)
otherwise takes a decode of the bytes into a float32 tensor, its division by the scale, a mask of the clipped inputs
(``|x · scale| > max``) and the statistics pass over all three (`stats.stats_from_masks`). `float8_cast_stats`
gives the same statistics, bit for bit, from one pass that writes nothing: ``qw_float8_stats`` in ``native.cpp`` takes
every sum in the order ``qw_stats`` takes it, from the same float32 values (the decode table is torch's conversion of
the 256 codes, `decode`; the division is correctly rounded, as torch's). tests/kernels/test_float8_stats.py holds the
two equal.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .decode import decode_table
from .partial_sums import ErrorStats, RowStats, pass_buffer, pass_fields

__all__ = ["float8_cast_stats"]

# The one-byte floats whose code b | 0x80 is the negation of code b (the kernel decodes a magnitude and a sign; in
# the fnuz formats 0x80 is NaN).
SIGNED_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def float8_cast_stats(x: Tensor, codes: Tensor, scale: Tensor, max_value: float) -> ErrorStats | None:
    """The error statistics (a CPU row) of the cast ``codes`` of ``x``, as
    ``stats_from_masks(x, codes.to(torch.float32) / scale, (x * scale).abs() > max_value)`` gives them when the
    native kernels run its statistics (bit for bit), in one pass of the loaded library.

    ``x``: contiguous float32 CPU; ``codes``: float8 e4m3fn or e5m2 of ``x``'s shape, contiguous; ``scale``:
    float32, one element (tensorwise) or one per row of ``x``'s last dimension (shape ``(*x.shape[:-1], 1)``, rowwise).
    None (the caller takes the tensors' way) when the library is not loaded, for anything else, and where the
    statistics pass would decline: a NaN/±inf in ``x`` or in the dequantized values, sums beyond its float32 runs."""
    lib = native.loaded()
    n = x.numel()
    if lib is None or x.dtype != torch.float32 or codes.dtype not in SIGNED_FLOAT8 or not 0 < n < native.MAX_NUMEL:
        return None
    if codes.shape != x.shape or not (_dense_cpu(x) and _dense_cpu(codes)):
        return None
    if not (scale.dtype == torch.float32 and scale.device.type == "cpu" and native.plain(scale)):
        return None
    scales_address, row, tensor_scale = None, n, 1.0
    if scale.numel() == 1:
        tensor_scale = float(scale)  # the kernel divides the table's values by it, once per code
    elif x.dim() and scale.shape == (*x.shape[:-1], 1) and scale.is_contiguous():
        scales_address, row = scale.data_ptr(), x.shape[-1]
    else:
        return None
    table = decode_table(codes.dtype)  # made once, held by `decode`
    partial = pass_buffer()
    threads = native.threads_for(n)
    status = lib.qw_float8_stats(
        x.data_ptr(),
        codes.data_ptr(),
        table.data_ptr(),
        scales_address,
        row,
        tensor_scale,
        max_value,
        n,
        partial.buffer_info()[0],
        threads,
    )
    fields = pass_fields(partial, n) if status == 0 else None
    return RowStats.of(fields) if fields is not None else None


def _dense_cpu(t: Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and native.plain(t)
