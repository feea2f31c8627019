"""The fused CPU fast path: quantize and every error statistic in one ``torch.compile``-generated pass.

The cast here is written independently of the reference, on bit patterns (the binade exponent is read from the
float32 exponent field, powers of two are assembled from bits), which is how a vectorising compiler wants it; tests
hold it bit-exact against `reference.quantize_reference`. Each configuration (format, scaling, rounding, saturation,
statistics on/off) is compiled once into its own function, and Dynamo marks shapes dynamic after the first change,
so a training loop reuses the same kernels.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .formats import (
    E8M0_EXPONENT_MAX,
    E8M0_EXPONENT_MIN,
    FP4_E2M1,
    FP8_E4M3,
    NVFP4_BLOCK_SCALE_MIN,
    FormatSpec,
    Kind,
    Special,
)
from .options import BackendUnavailableError, Rounding, Scaling, ScalingSpec
from .reference import from_blocks, to_blocks
from .stats import ErrorStats

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NUMEL = 1 << 32


@dataclass(frozen=True)
class FusedConfig:
    """The static part of one fused quantization; each distinct value compiles its own kernels."""

    fmt: FormatSpec
    scaling: ScalingSpec
    stochastic: bool
    saturate: bool
    with_stats: bool
    given_scale: bool


def element_unsupported_reason(x: Tensor, fmt: FormatSpec) -> str | None:
    """Why neither fused path (compiled, Triton) can run on this dtype and element format, or None."""
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} (supported: float32, bfloat16, float16)"
    if fmt.kind is Kind.SCALE:
        return "the e8m0 scale format as an element format"
    return None


def unsupported_reason(x: Tensor, fmt: FormatSpec, spec: ScalingSpec) -> str | None:
    """Why the compiled path cannot run this quantization, or None when it can."""
    reason = element_unsupported_reason(x, fmt)
    if reason is not None:
        return reason
    if x.numel() >= MAX_NUMEL:
        return f"tensors of {MAX_NUMEL} elements or more (packed 32-bit counts)"
    return None


def supports(x: Tensor, fmt: FormatSpec, spec: ScalingSpec) -> bool:
    """True when the compiled path can run this quantization."""
    return unsupported_reason(x, fmt, spec) is None


def check_supported(x: Tensor, fmt: FormatSpec, spec: ScalingSpec) -> None:
    """Raise `BackendUnavailableError` naming why the compiled path cannot run this quantization."""
    reason = unsupported_reason(x, fmt, spec)
    if reason is not None:
        raise BackendUnavailableError(f"compiled backend does not support {reason}")


def pow2_bits(exponent: Tensor) -> Tensor:
    """2**exponent (int32, -127…127) from the float32 bit pattern; 2^-127 is the one subnormal needed (E8M0's min)."""
    normal = ((exponent.clamp(-126, 127) + 127) << 23).view(torch.float32)
    return torch.where(exponent < -126, 2.0**-127, normal)


def binade_exponent(a: Tensor) -> Tensor:
    """floor(log2(a)) for non-negative float32 ``a`` from its exponent field; zero and subnormals read as -127."""
    return (a.view(torch.int32) >> 23) - 127


def cast_bits(v: Tensor, fmt: FormatSpec, saturate: bool, noise: Tensor | None) -> tuple[Tensor, Tensor]:
    """Round float32 ``v`` to ``fmt`` like `reference.cast_with_overflow`, on bit patterns: ``(q, overflow)``."""
    finite = torch.isfinite(v)
    if fmt.kind is Kind.INT:
        rounded = torch.round(v) if noise is None else _stochastic(v, noise)
        return rounded.clamp(-fmt.max_value, fmt.max_value), finite & (rounded.abs() > fmt.max_value)
    a = torch.where(finite, v.abs(), 0.0)
    exponent = torch.clamp(binade_exponent(a), min=fmt.emin)
    scaled = a * pow2_bits(fmt.mantissa_bits - exponent)
    rounded = torch.round(scaled) if noise is None else _stochastic(scaled, noise)
    result = rounded * pow2_bits(exponent - fmt.mantissa_bits)
    too_big = result > fmt.max_value
    overflow = too_big | ~finite
    if saturate or fmt.special is Special.NONE:
        result = torch.where(overflow, fmt.max_value, result)
    elif fmt.special is Special.IEEE:
        result = torch.where(overflow, torch.inf, result)
    else:
        result = torch.where(overflow, torch.nan, result)
    # `v != v` is NaN; Inductor vectorises the comparison but not torch.isnan (a scalar loop, half the runtime).
    return torch.where(v != v, torch.nan, torch.copysign(result, v)), too_big & finite


def overflow_threshold(fmt: FormatSpec) -> tuple[float, bool]:
    """(T, ties_up): round-to-nearest-even takes ``|v|`` past the maximum iff ``|v| > T`` or (``|v| == T`` and ties_up).

    T is the maximum plus half its unit in the last place; the tie rounds up when the maximum's last bit is odd (all
    formats but E4M3, whose all-ones mantissa at the top exponent is NaN).
    """
    if fmt.kind is Kind.INT:
        return fmt.max_value + 0.5, int(fmt.max_value) % 2 == 1
    ulp = 2.0 ** (fmt.emax - fmt.mantissa_bits)
    return fmt.max_value + ulp / 2, round(fmt.max_value / ulp) % 2 == 1


def nearest_overflow(scaled: Tensor, fmt: FormatSpec) -> Tensor:
    """The overflow mask of `cast_bits` under round-to-nearest, from the input alone."""
    threshold, ties_up = overflow_threshold(fmt)
    magnitude = scaled.abs()
    beyond = (magnitude >= threshold) if ties_up else (magnitude > threshold)
    return beyond & torch.isfinite(scaled)


def _stochastic(scaled: Tensor, noise: Tensor) -> Tensor:
    low = torch.floor(scaled)
    return low + (noise < scaled - low).to(torch.float32)


def _tensor_scale(amax: Tensor, fmt: FormatSpec, spec: ScalingSpec) -> Tensor:
    scale = amax / fmt.max_value
    if spec.margin:
        scale = scale * 2.0**spec.margin
    if spec.pow2:
        bits = scale.view(torch.int32)
        up = (((bits >> 23) + 1) << 23).view(torch.float32)
        scale = torch.where((bits & 0x7FFFFF) == 0, scale, up)
    return torch.where(scale > 0, scale, 1.0)


def _scales(
    v: Tensor, finite_abs: Tensor, amax: Tensor, given: Tensor | None, config: FusedConfig
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(element scale broadcastable to v, scale to report, NVFP4 tensor scale)."""
    fmt, spec = config.fmt, config.scaling
    if spec.kind in (Scaling.TENSOR, Scaling.DELAYED):
        scale = given if given is not None else _tensor_scale(amax, fmt, spec)
        return scale, scale, None
    if spec.kind is Scaling.CHANNEL:
        if v.dim() == 0:
            channel_amax = finite_abs
        else:
            keep = spec.axis % v.dim()
            dims = [d for d in range(v.dim()) if d != keep]
            channel_amax = finite_abs.amax(dim=dims, keepdim=True) if dims else finite_abs
        scale = _tensor_scale(channel_amax, fmt, ScalingSpec(Scaling.TENSOR))
        return scale, scale, None
    block_amax = finite_abs.amax(dim=-1, keepdim=True)
    if spec.kind is Scaling.BLOCK:
        shared = (binade_exponent(block_amax) - fmt.emax).clamp(E8M0_EXPONENT_MIN, E8M0_EXPONENT_MAX)
        scale = pow2_bits(shared)
        return scale, scale.squeeze(-1), None
    tensor_scale = amax / (FP8_E4M3.max_value * FP4_E2M1.max_value)
    tensor_scale = torch.where(tensor_scale > 0, tensor_scale, 1.0)
    raw = (block_amax / fmt.max_value) / tensor_scale
    block_scale = cast_bits(raw.clamp(NVFP4_BLOCK_SCALE_MIN, FP8_E4M3.max_value), FP8_E4M3, True, None)[0]
    return tensor_scale * block_scale, block_scale.squeeze(-1), tensor_scale


def fused_quantize(
    x: Tensor, noise: Tensor | None, given_scale: Tensor | None, config: FusedConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Quantize and measure in one traced graph: ``(values, stats as FIELDS vector, scale, amax, tensor scale)``.

    Eager-runnable; `quantize_fused` runs it compiled.
    """
    fmt, spec = config.fmt, config.scaling
    blocked = spec.kind in (Scaling.BLOCK, Scaling.NVBLOCK)
    v = x.to(torch.float32)
    xs = x
    if blocked:
        v = to_blocks(v, spec.block_size)
        xs = to_blocks(x, spec.block_size)
        noise = to_blocks(noise, spec.block_size) if noise is not None else None
    finite_x = torch.isfinite(v)
    finite_abs = torch.where(finite_x, v.abs(), 0.0)
    amax = finite_abs.amax()
    if spec.kind is Scaling.NONE:
        scaled = v
        q, overflow = cast_bits(v, fmt, config.saturate, noise)
        scale_out: Tensor = torch.ones((), dtype=torch.float32, device=x.device)
        tensor_scale = None
    else:
        element_scale, scale_out, tensor_scale = _scales(v, finite_abs, amax, given_scale, config)
        scaled = v / element_scale
        cast, overflow = cast_bits(scaled, fmt, config.saturate, noise)
        q = cast * element_scale
    if noise is None:
        # The same mask from the input side; the cast's own mask made Inductor store it and re-read it in a second
        # pass for NVFP4.
        overflow = nearest_overflow(scaled, fmt)
    values = q.to(x.dtype)
    if config.with_stats:
        stats = _stats_vector(xs, values, overflow, amax, x.numel())
    else:
        stats = torch.zeros(len(ErrorStats.FIELDS), dtype=torch.float64, device=x.device)
    if blocked:
        values = from_blocks(values, x.shape)
    return values, stats, scale_out, amax, tensor_scale


def _stats_vector(x: Tensor, q: Tensor, overflow: Tensor, amax: Tensor, numel: int) -> Tensor:
    # Sums accumulate in float64 like the reference. Finiteness is recomputed here rather than shared with the amax
    # pass (sharing it made Inductor materialise the mask and re-read it in an extra, slow loop), and the amax pass's
    # result is reused for the ``amax`` field.
    finite_x = torch.isfinite(x)
    finite_q = torch.isfinite(q)
    valid = finite_x & finite_q
    xv = torch.where(valid, x, 0).to(torch.float64)
    qv = torch.where(valid, q, 0).to(torch.float64)
    err = qv - xv
    nonzero = finite_x & (x != 0)
    clipped = finite_x & (overflow | ~finite_q)
    sums = torch.stack([(xv * xv).sum(), (qv * qv).sum(), (qv * xv).sum(), (err * err).sum()])
    # Two packed int64 counts (low and high 32 bits) instead of four: with four count reductions Inductor split one
    # into a second pass over a materialised mask, which cost more than the rest of the kernel.
    packed = torch.stack(
        [
            (nonzero.to(torch.int64) + ((nonzero & (q == 0)).to(torch.int64) << 32)).sum(),
            (clipped.to(torch.int64) + ((~finite_x).to(torch.int64) << 32)).sum(),
        ]
    )
    low_mask = (1 << 32) - 1
    counts = torch.stack([packed[0] & low_mask, packed[0] >> 32, packed[1] & low_mask, packed[1] >> 32])
    return torch.cat(
        [
            torch.full((1,), numel, dtype=torch.float64, device=x.device),
            sums,
            torch.stack([err.abs().amax(), amax.to(torch.float64)]),
            counts.to(torch.float64),
        ]
    )


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    # Dynamo keeps compiled variants per code object and stops recompiling after `recompile_limit` of them; giving
    # every configuration its own code object keeps that limit for shape changes instead of configurations.
    if not isinstance(fn, types.FunctionType):
        raise TypeError("expected a plain function")
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)


@functools.cache
def compiled_for(config: FusedConfig) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]]:
    """The compiled fused function for one configuration (built once, then reused)."""
    body = _own_code(fused_quantize, f"fused_{config.fmt.name}_{config.scaling.kind.value}_{id(config)}")

    def run(x: Tensor, noise: Tensor | None, scale: Tensor | None) -> Any:
        return body(x, noise, scale, config)

    compiled: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]] = torch.compile(
        _own_code(run, f"run_{id(config)}")
    )
    return compiled


def quantize_fused(
    x: Tensor,
    fmt: FormatSpec,
    spec: ScalingSpec,
    rounding: Rounding,
    saturate: bool,
    noise: Tensor | None,
    scale: Tensor | None,
    with_stats: bool,
) -> tuple[Tensor, ErrorStats | None, Tensor, Tensor]:
    """Run the compiled fused quantization: ``(values, stats or None, scale, amax)``.

    Raises `BackendUnavailableError` when this quantization is unsupported or torch.compile cannot build it.
    """
    check_supported(x, fmt, spec)
    config = FusedConfig(fmt, spec, rounding is Rounding.STOCHASTIC, saturate, with_stats, scale is not None)
    given = scale.to(device=x.device, dtype=torch.float32) if scale is not None else None
    try:
        values, stats, scale_out, amax, _ = compiled_for(config)(x.detach(), noise, given)
    except (RuntimeError, OSError, ImportError) as error:
        raise BackendUnavailableError(f"torch.compile could not build the fused kernel: {error}") from error
    return values, ErrorStats.from_tensor(stats) if with_stats else None, scale_out, amax
