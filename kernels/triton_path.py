"""The fused CUDA fast path: Triton kernels that quantize and write per-program partial statistics in one pass.

Per-tensor scalings (none, tensor, delayed) run a flat kernel after one amax reduction; block scalings (OCP MX
``block:N`` and NVFP4 ``nvblock:N``) run a kernel over rows of one block each, computing the block's scale in
registers. Partial sums are float64 per program and summed by torch afterwards (deterministic, no atomics). The cast
follows `compiled.cast_bits` (bit patterns, round-half-even via ``rint``) and is tested bit-exact against the
reference, on CPU tensors under ``TRITON_INTERPRET=1`` when no GPU is present.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch
from torch import Tensor

from .backends import QuantRequest, QuantResult, raise_if_unsupported
from .casts import element_unsupported_reason
from .formats import FP4_E2M1, FP8_E4M3, NVFP4_BLOCK_SCALE_MIN, FormatSpec, Kind, Special
from .options import Backend, Rounding, Scaling, ScalingSpec
from .partial_sums import ErrorStats
from .reference import amax_to_scale, finite_amax, from_blocks, to_blocks

# The `backends.FastPath` protocol, implemented by this module.
NAME = Backend.TRITON

_SPECIAL_CODES = {Special.NONE: 0, Special.IEEE: 1, Special.FN: 2, Special.NAN_ONLY: 2}
_STAT_COUNT = len(ErrorStats.FIELDS)
_MAX_FIELDS = (ErrorStats.FIELDS.index("max_abs_err"), ErrorStats.FIELDS.index("amax"))
ELEMENTS_PER_PROGRAM = 1024
BLOCKS_PER_PROGRAM = 32


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_installed() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def unsupported_reason(x: Tensor, fmt: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool) -> str | None:
    """Why the Triton path cannot run this quantization, or None when it can (every rounding and saturation)."""
    if not triton_installed():
        return "this environment (triton is not installed)"
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        return f"{x.device.type} tensors (CUDA, or CPU under TRITON_INTERPRET=1)"
    reason = element_unsupported_reason(x, fmt)
    if reason is not None:
        return reason
    if spec.kind is Scaling.CHANNEL:
        return "channel scaling"
    return None


def available() -> bool:
    """True when Triton is installed (whether it compiles for this GPU shows when a kernel first runs)."""
    return triton_installed()


def prepare() -> None:
    """Nothing to prepare: Triton compiles each kernel on its first launch."""


def quantize(request: QuantRequest) -> QuantResult:
    """`quantize_fused` (``out`` is the caller's to fill)."""
    return quantize_fused(request)


def _kernels() -> Any:
    return importlib.import_module(f"{__package__}.triton_kernels")


def _format_constants(fmt: FormatSpec, saturate: bool, stochastic: bool) -> dict[str, Any]:
    return {
        "EMIN": fmt.emin if fmt.kind is Kind.FLOAT else 0,
        "MBITS": fmt.mantissa_bits,
        "MAXV": fmt.max_value,
        "SPECIAL": _SPECIAL_CODES[fmt.special],
        "IS_INT": fmt.kind is Kind.INT,
        "SATURATE": saturate,
        "STOCHASTIC": stochastic,
    }


def _reduce_partials(partial: Tensor, numel: int) -> Tensor:
    totals = partial.sum(dim=0)
    maxima = partial.amax(dim=0)
    for index in _MAX_FIELDS:
        totals[index] = maxima[index]
    totals[0] = numel
    return totals


def quantize_fused(request: QuantRequest) -> QuantResult:
    """Run the Triton fused quantization: ``(values, stats or None, scale, amax)``.

    Raises `BackendUnavailableError` when Triton is missing, the tensor is not on CUDA (or CPU under the
    interpreter), or the quantization is unsupported (channel scaling, e8m0 elements, float64).
    """
    x, fmt, spec, rounding, saturate = request.x, request.fmt, request.spec, request.rounding, request.saturate
    noise, scale, with_stats = request.noise, request.scale, request.with_stats
    raise_if_unsupported(NAME, unsupported_reason(x, fmt, spec, rounding, saturate))
    kernels = _kernels()
    stochastic = rounding is Rounding.STOCHASTIC
    constants = _format_constants(fmt, saturate, stochastic)
    source = x.detach()
    amax = finite_amax(source).to(torch.float32)
    blocked = spec.kind in (Scaling.BLOCK, Scaling.NVBLOCK)
    if blocked:
        blocks = to_blocks(source, spec.block_size).contiguous()
        n_blocks = blocks.numel() // spec.block_size
        noise_in = to_blocks(noise, spec.block_size).contiguous() if noise is not None else blocks
        q = torch.empty_like(blocks)
        block_scale = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
        nv = spec.kind is Scaling.NVBLOCK
        tensor_scale = amax / (FP8_E4M3.max_value * FP4_E2M1.max_value)
        tensor_scale = torch.where(tensor_scale > 0, tensor_scale, 1.0).reshape(1)
        programs = -(-n_blocks // BLOCKS_PER_PROGRAM)
        partial = torch.zeros(programs, _STAT_COUNT, dtype=torch.float64, device=x.device)
        kernels.block_kernel[(programs,)](
            blocks, noise_in, q, block_scale, tensor_scale, partial, n_blocks,
            BS=spec.block_size, BS_POW2=max(16, 1 << (spec.block_size - 1).bit_length()), ROWS=BLOCKS_PER_PROGRAM,
            EMAX=fmt.emax, NV=nv, WITH_STATS=with_stats, E4M3_MAX=FP8_E4M3.max_value,
            NV_SCALE_MIN=NVFP4_BLOCK_SCALE_MIN, **constants,
        )  # fmt: skip
        values = from_blocks(q, x.shape)
        scale_out = block_scale.reshape(blocks.shape[:-1])
    else:
        flat = source.contiguous().reshape(-1)
        scaled = spec.kind is not Scaling.NONE
        if spec.kind is Scaling.NONE:
            scale_out = torch.ones((), dtype=torch.float32, device=x.device)
        elif scale is not None:
            scale_out = scale.to(device=x.device, dtype=torch.float32).reshape(())
        else:
            scale_out = amax_to_scale(amax, fmt, pow2=spec.pow2, margin=spec.margin)
        noise_in = noise.contiguous().reshape(-1) if noise is not None else flat
        q = torch.empty_like(flat)
        programs = -(-flat.numel() // ELEMENTS_PER_PROGRAM)
        partial = torch.zeros(programs, _STAT_COUNT, dtype=torch.float64, device=x.device)
        kernels.flat_kernel[(programs,)](
            flat, noise_in, q, scale_out.reshape(1), partial, flat.numel(),
            SCALED=scaled, WITH_STATS=with_stats, BLOCK=ELEMENTS_PER_PROGRAM, **constants,
        )  # fmt: skip
        values = q.reshape(x.shape)
    stats = ErrorStats.from_tensor(_reduce_partials(partial, x.numel())) if with_stats else None
    return values, stats, scale_out, amax
