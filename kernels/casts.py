"""The float32 casts of the fused paths (compiled, and Triton's supported-input check), written independently of the
reference: under round-to-nearest, minifloats round in float32 arithmetic alone (`cast_nearest`: Veltkamp splitting, a
magic-number add), which Inductor vectorises; stochastic rounding and integers round on scaled values whose powers of
two are assembled from bits (`cast_bits`). Tests hold both bit-exact against `reference.quantize_reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FormatSpec, Kind
from .reference import replace_overflow

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def element_unsupported_reason(x: Tensor, fmt: FormatSpec) -> str | None:
    """Why neither fused path (compiled, Triton) can run on this dtype and element format, or None."""
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} (supported: float32, bfloat16, float16)"
    if fmt.kind is Kind.SCALE:
        return "the e8m0 scale format as an element format"
    return None


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
        rounded = torch.round(v) if noise is None else stochastic(v, noise)
        return rounded.clamp(-fmt.max_value, fmt.max_value), finite & (rounded.abs() > fmt.max_value)
    a = torch.where(finite, v.abs(), 0.0)
    exponent = torch.clamp(binade_exponent(a), min=fmt.emin)
    scaled = a * pow2_bits(fmt.mantissa_bits - exponent)
    rounded = torch.round(scaled) if noise is None else stochastic(scaled, noise)
    result = rounded * pow2_bits(exponent - fmt.mantissa_bits)
    too_big = result > fmt.max_value
    overflow = too_big | ~finite
    result = replace_overflow(result, overflow, fmt, saturate)
    # `v != v` is NaN; Inductor vectorises the comparison but not torch.isnan (a scalar loop, half the runtime).
    return torch.where(v != v, torch.nan, torch.copysign(result, v)), too_big & finite


def cast_nearest(v: Tensor, fmt: FormatSpec, saturate: bool) -> Tensor:
    """`cast_bits` under round-to-nearest-even for minifloats, in float32 arithmetic alone (no bit casts).

    Inductor's CPU code casts float32 to int32 bits one element at a time; these operations all vectorise. Normal
    values round by Veltkamp splitting: with ``c = a·(2^(23−m) + 1)``, ``c − (c − a)`` is ``a`` rounded to m
    mantissa bits, ties to even (exact in float32 while ``c`` does not overflow, hence the clamp to 2^(emax+2), which
    still rounds past the maximum). Below the smallest normal the format's spacing is fixed at 2^(emin−m), and adding
    then subtracting ``2^(emin−m+23)`` rounds to it (the sum's last place is that spacing). Overflow is decided on the
    input, as in `nearest_overflow`.
    """
    beyond = beyond_threshold(v, fmt)
    a = v.abs()
    bound = 2.0 ** (fmt.emax + 2)
    clamped = torch.where(a > bound, bound, a)
    split = clamped * (2.0 ** (23 - fmt.mantissa_bits) + 1)
    normal = split - (split - clamped)
    magic = 2.0 ** (fmt.emin - fmt.mantissa_bits + 23)
    subnormal = (clamped + magic) - magic
    rounded = torch.where(clamped < 2.0**fmt.emin, subnormal, normal)
    rounded = replace_overflow(rounded, beyond, fmt, saturate)
    # torch.copysign compiles to a library call, which makes the compiler spill every vector register around it;
    # negating where v < 0 does not, and zero results take v's sign from v · 0 (v is finite there).
    signed = torch.where(v < 0, -rounded, rounded)
    signed = torch.where(rounded == 0, v * 0.0, signed)
    return torch.where(v != v, torch.nan, signed)


def cast_saturating(v: Tensor, fmt: FormatSpec, clamp: bool = True) -> Tensor:
    """`cast_nearest` of finite ``v`` for a minifloat that saturates, rounding signed values (no sign masks).

    Clamping to ±max first is saturation itself (a value within the range never rounds past the maximum); without
    ``clamp`` every ``|v|`` must already round to at most the maximum (below `overflow_threshold`), as under a scale
    taken from the amax or an NVFP4 block scale. Normal values round by Veltkamp splitting, which is symmetric in the
    sign; below the smallest normal ``round`` (vectorised, half to even, keeps the sign of a zero) rounds to the fixed
    spacing 2^(emin−m). NaN and ±inf are not handled: callers check the sums and rerun the masked kernels.
    """
    c = v.clamp(-fmt.max_value, fmt.max_value) if clamp else v
    split = c * (2.0 ** (23 - fmt.mantissa_bits) + 1)
    normal = split - (split - c)
    steps_per_unit = 2.0 ** (fmt.mantissa_bits - fmt.emin)
    subnormal = torch.round(c * steps_per_unit) * (1 / steps_per_unit)
    return torch.where(c.abs() < 2.0**fmt.emin, subnormal, normal)


def cast(v: Tensor, fmt: FormatSpec, saturate: bool, noise: Tensor | None) -> Tensor:
    if noise is None and fmt.kind is Kind.FLOAT:
        return cast_nearest(v, fmt, saturate)
    return cast_bits(v, fmt, saturate, noise)[0]


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
    return beyond_threshold(scaled, fmt) & torch.isfinite(scaled)


def stochastic(scaled: Tensor, noise: Tensor) -> Tensor:
    low = torch.floor(scaled)
    return low + (noise < scaled - low).to(torch.float32)


def beyond_threshold(scaled: Tensor, fmt: FormatSpec) -> Tensor:
    """Where round-to-nearest-even takes ``|scaled|`` past the format's maximum (NaN: never, ±inf: always)."""
    threshold, ties_up = overflow_threshold(fmt)
    magnitude = scaled.abs()
    return (magnitude >= threshold) if ties_up else (magnitude > threshold)
