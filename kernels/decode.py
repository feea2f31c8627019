"""Float8 tensors to float32 in one native pass: torch's own conversion of a float8 CPU tensor runs element by
element (about 35 times an elementwise multiply on an AVX-512 host), which is most of what measuring a float8 cast
costs. The values are torch's own: the table of all 256 codes is made by torch's conversion."""

from __future__ import annotations

import torch
from torch import Tensor

from . import native

__all__ = ["decode_table", "float8_to_float32"]

_TABLES: dict[torch.dtype, Tensor] = {}
_ONE_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def decode_table(dtype: torch.dtype) -> Tensor:
    """The float32 values of the 256 codes of one-byte float ``dtype``, by torch's conversion (made once)."""
    table = _TABLES.get(dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)
        _TABLES[dtype] = table
    return table


def float8_to_float32(t: Tensor, divisor: Tensor | None = None) -> Tensor | None:
    """``t.to(torch.float32)``, bit for bit, for a one-byte float CPU tensor laid out densely (contiguous, or a
    transposed contiguous matrix: the result has ``t``'s strides); None when the native library is not loaded (it is
    never built here) or ``t`` is anything else.

    ``divisor`` (a one-element float32 CPU tensor): ``t.to(torch.float32) / divisor`` instead, in the same pass, bit
    for bit (the table of the 256 codes is divided, by the same float32 division)."""
    lib = native.loaded()
    if lib is None or t.dtype not in _ONE_BYTE_FLOATS or t.device.type != "cpu":
        return None
    table = decode_table(t.dtype)
    if divisor is not None:
        if divisor.numel() != 1 or divisor.dtype != torch.float32 or divisor.device.type != "cpu":
            return None
        table = table / divisor.reshape(())
    if not (t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())):
        return None
    out = torch.empty_like(t, dtype=torch.float32)  # dense: the same strides, so memory orders match
    if out.stride() != t.stride():
        return None
    n = t.numel()
    threads = native.threads_for(n)
    lib.qw_decode_bytes(t.data_ptr(), table.data_ptr(), out.data_ptr(), n, threads)
    return out
