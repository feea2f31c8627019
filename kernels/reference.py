"""The plain-torch reference quantizer: the source of truth every fast path is tested bit-exact against.

The cast is one generic minifloat rounding parameterised by the format's exponent range, mantissa bits and
special-value policy (`FormatSpec`), computed exactly in float32 (float64 for float64 inputs): a value's binade
exponent comes from ``frexp``, it is scaled by a power of two so that one unit of the format's last mantissa place is
1, rounded to an integer (ties to even, or stochastically) and scaled back. Powers of two are built from their bit
patterns, so every step is exact and the only rounding is the intended one.

Special values (OCP OFP8 rev 1.0 §3, OCP MX v1.0 §5):

* saturating mode (default): finite overflow and ±inf become ±max;
* non-saturating mode: overflow becomes ±inf for E5M2 and NaN for E4M3 and E8M0; FP6/FP4/integers have no encoding
  to overflow to, so they saturate in both modes (as ``ml_dtypes`` does);
* NaN stays NaN in every format (FP6/FP4/integers have no NaN code; the fake-quantized tensor keeps it visible);
* E8M0 is unsigned and has no zero: ``x <= 0`` gives NaN, magnitudes below 2^-127 round to 2^-127.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.functional import pad as pad_tensor

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
from .options import Rounding, Scaling, ScalingSpec


@dataclass(frozen=True)
class QuantDetails:
    """Everything one quantization produced.

    ``values``: the fake-quantized tensor (shape and dtype of the input). ``scale``: the dequantization scale in
    float32 (``x ≈ scale · Q(x / scale)``): 0-dim for none/tensor/delayed, the input's shape with the reduced
    dimensions kept (size 1) for channel, and ``(*x.shape[:-1], n_blocks)`` for block scalings (for NVFP4 these are the
    E4M3 block scales, the element scale being ``tensor_scale · scale``). ``tensor_scale``: NVFP4's FP32 per-tensor
    scale, else None. ``amax``: the largest finite ``|x|`` (float32, 0-dim). Masks (bool, input shape):
    ``overflow_mask`` finite inputs whose scaled value rounded beyond the format maximum (clipped),
    ``underflow_mask`` non-zero finite inputs that became zero, ``nonfinite_mask`` NaN/±inf inputs.
    """

    values: Tensor
    scale: Tensor
    tensor_scale: Tensor | None
    amax: Tensor
    overflow_mask: Tensor
    underflow_mask: Tensor
    nonzero_mask: Tensor
    nonfinite_mask: Tensor
    fmt: FormatSpec
    scaling: ScalingSpec


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float64 inputs are quantized in float64 (no double rounding); everything else in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def exact_pow2(exponent: Tensor, dtype: torch.dtype) -> Tensor:
    """2**exponent for integer tensors, built from the bit pattern (exact, unlike ``exp2``/``pow`` on some CPUs).

    Float32 covers exponents -149…127 (below -126 the result is subnormal, reached by two exact multiplications).
    """
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    e = exponent.to(torch.int32)
    normal = ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    tiny = ((e.clamp(-190, -127) + 64 + 127) << 23).view(torch.float32) * 2.0**-64
    return torch.where(e >= -126, normal, tiny)


def floor_log2(a: Tensor) -> Tensor:
    """floor(log2(a)) as int32 for positive finite ``a`` (exact, via frexp); 0 for ``a == 0``."""
    _, exponent = torch.frexp(a)
    return torch.where(a > 0, exponent - 1, 0).to(torch.int32)


def draw_noise(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Uniform [0, 1) float32 draws for stochastic rounding; every backend draws them this way, in this order."""
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def _round_integer(scaled: Tensor, rounding: Rounding, noise: Tensor | None) -> Tensor:
    if rounding is Rounding.NEAREST:
        return torch.round(scaled)  # round half to even
    if noise is None:
        raise ValueError("rounding: stochastic rounding needs noise (draw_noise)")
    low = torch.floor(scaled)
    # Round up with probability equal to the fractional part: E[result] == scaled.
    return low + (noise.to(scaled.dtype) < scaled - low).to(scaled.dtype)


def replace_overflow(result: Tensor, overflow: Tensor, fmt: FormatSpec, saturate: bool) -> Tensor:
    """``result`` with its ``overflow`` elements replaced as the format defines (magnitudes; callers apply the sign):
    the maximum when saturating or for formats without inf/NaN, inf for IEEE-style formats, NaN for the others."""
    if saturate or fmt.special is Special.NONE:
        return torch.where(overflow, fmt.max_value, result)
    if fmt.special is Special.IEEE:
        return torch.where(overflow, torch.inf, result)
    return torch.where(overflow, torch.nan, result)


def cast_with_overflow(
    v: Tensor,
    fmt: FormatSpec,
    rounding: Rounding = Rounding.NEAREST,
    saturate: bool = True,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Round ``v`` (float32/float64) to the nearest value of ``fmt`` (or stochastically), in the same dtype, and the
    mask of finite inputs that overflowed: rounded beyond ±max, so clipped or inf/NaN.

    A value just above the maximum that rounds down to it (448.2 in E4M3) is rounding, not overflow.
    """
    finite = torch.isfinite(v)
    if fmt.kind is Kind.INT:
        limit = fmt.max_value
        rounded = _round_integer(v, rounding, noise)
        return rounded.clamp(-limit, limit), finite & (rounded.abs() > limit)
    magnitude = v.abs()
    a = torch.where(finite, magnitude, 0)
    # The binade exponent; below the normal range the subnormal spacing applies (OCP OFP8 §3: denormals).
    exponent = floor_log2(a).clamp(min=fmt.emin)
    shift = fmt.mantissa_bits - exponent
    rounded = _round_integer(a * exact_pow2(shift, a.dtype), rounding, noise) * exact_pow2(-shift, a.dtype)
    too_big = rounded > fmt.max_value
    overflow = too_big | ~finite
    rounded = replace_overflow(rounded, overflow, fmt, saturate)
    if fmt.kind is Kind.SCALE:
        rounded = torch.where(rounded < fmt.min_normal, fmt.min_normal, rounded)
        return torch.where(v > 0, rounded, torch.nan), too_big & finite
    return torch.where(torch.isnan(v), torch.nan, torch.copysign(rounded, v)), too_big & finite


def finite_amax(x: Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> Tensor:
    """Largest finite ``|x|`` (0 for none): NaN/±inf never set a scale, they go through the cast on their own."""
    magnitude = torch.where(torch.isfinite(x), x.abs(), 0)
    if dim is None:
        return magnitude.amax()
    return magnitude.amax(dim=dim, keepdim=keepdim)


def amax_to_scale(amax: Tensor, fmt: FormatSpec, pow2: bool = False, margin: int = 0) -> Tensor:
    """Dequantization scale ``amax / max · 2^margin`` (1 where it would be 0); ``pow2`` rounds it up to 2^k.

    Rounding up (never down) keeps ``amax / scale <= max``, so a power-of-two scale never clips (TransformerEngine
    rounds its multiplicative scale down to a power of two for the same reason).
    """
    scale = amax.to(torch.float32) / fmt.max_value
    if margin:
        scale = scale * 2.0**margin
    if pow2:
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, exact_pow2(exponent, torch.float32))
    return torch.where(scale > 0, scale, 1.0)


def mx_shared_exponent(block_amax: Tensor, fmt: FormatSpec) -> Tensor:
    """OCP MX v1.0 §6.3: shared exponent ``floor(log2(amax)) − emax_elem``, clamped to E8M0's range (int32).

    A block whose amax is 0 gets the smallest scale 2^-127 (pytorch/ao does the same).
    """
    unclamped = floor_log2(block_amax) - fmt.emax
    exponent = torch.where(block_amax > 0, unclamped, E8M0_EXPONENT_MIN)
    return exponent.clamp(E8M0_EXPONENT_MIN, E8M0_EXPONENT_MAX)


def nvfp4_tensor_scale(amax: Tensor) -> Tensor:
    """NVFP4 FP32 per-tensor scale ``amax / (448 · 6)`` (1 when amax is 0), as in pytorch/ao's nvfp4_tensor."""
    scale = amax.to(torch.float32) / (FP8_E4M3.max_value * FP4_E2M1.max_value)
    return torch.where(scale > 0, scale, 1.0)


def nvfp4_block_scale(block_amax: Tensor, tensor_scale: Tensor, element: FormatSpec) -> Tensor:
    """NVFP4 E4M3 block scale: ``(amax / max_elem) / tensor_scale`` clamped to [2^-6, 448] and rounded to E4M3."""
    raw = (block_amax.to(torch.float32) / element.max_value) / tensor_scale
    return cast_with_overflow(raw.clamp(NVFP4_BLOCK_SCALE_MIN, FP8_E4M3.max_value), FP8_E4M3)[0]


def to_blocks(v: Tensor, block_size: int) -> Tensor:
    """View the last dimension as blocks of ``block_size`` (zero-padding a partial last block): ``(..., nb, bs)``."""
    if v.dim() == 0:
        v = v.reshape(1)
    pad = (-v.shape[-1]) % block_size
    if pad:
        v = pad_tensor(v, (0, pad))
    return v.reshape(*v.shape[:-1], v.shape[-1] // block_size, block_size)


def from_blocks(blocks: Tensor, shape: torch.Size) -> Tensor:
    """Inverse of `to_blocks`: drop the padding and restore ``shape``."""
    last = shape[-1] if len(shape) else 1
    flat = blocks.reshape(*blocks.shape[:-2], -1)[..., :last]
    return flat.reshape(shape)


def channel_dims(ndim: int, axis: int) -> tuple[int, ...]:
    """The dimensions reduced by per-channel scaling along ``axis``; ``ValueError`` for an axis out of range."""
    if ndim == 0:
        return ()
    if not -ndim <= axis < ndim:
        raise ValueError(f"scaling: channel axis {axis} out of range for a {ndim}-D tensor")
    keep = axis % ndim
    return tuple(d for d in range(ndim) if d != keep)


def check_input(x: object) -> Tensor:
    """``TypeError`` unless ``x`` is a floating-point tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    return x


def quantize_reference(
    x: Tensor,
    fmt: FormatSpec,
    scaling: ScalingSpec,
    rounding: Rounding = Rounding.NEAREST,
    saturate: bool = True,
    generator: torch.Generator | None = None,
    scale: Tensor | None = None,
    noise: Tensor | None = None,
) -> QuantDetails:
    """Fake-quantize ``x`` to ``fmt`` under ``scaling``, in plain torch; the definition every backend must match.

    ``scale`` overrides the per-tensor scale of ``tensor``/``delayed`` scaling (the delayed-scaling state supplies it);
    without it, delayed scaling uses the current amax (an empty history). Stochastic rounding uses ``noise`` when
    given, else draws ``draw_noise(x.shape, generator, x.device)``.
    """
    dtype = working_dtype(x.dtype)
    v = x.detach().to(dtype)
    if v.numel() == 0:
        return empty_details(x, fmt, scaling)
    if rounding is Rounding.STOCHASTIC and noise is None:
        noise = draw_noise(x.shape, generator, x.device)
    amax = finite_amax(v).to(torch.float32)
    tensor_scale: Tensor | None = None
    kind = scaling.kind
    if kind is Scaling.NONE:
        element_scale = torch.ones((), dtype=torch.float32, device=x.device)
        scale_out = element_scale
        scaled = v
    elif kind in (Scaling.TENSOR, Scaling.DELAYED):
        if scale is None:
            scale = amax_to_scale(amax, fmt, pow2=scaling.pow2, margin=scaling.margin)
        element_scale = scale.to(torch.float32)
        scale_out = element_scale
        scaled = v / element_scale.to(dtype)
    elif kind is Scaling.CHANNEL:
        dims = channel_dims(v.dim(), scaling.axis)
        channel_amax = finite_amax(v, dim=dims, keepdim=True) if dims else torch.where(torch.isfinite(v), v.abs(), 0)
        element_scale = amax_to_scale(channel_amax, fmt)
        scale_out = element_scale
        scaled = v / element_scale.to(dtype)
    else:
        blocks = to_blocks(v, scaling.block_size)
        block_amax = finite_amax(blocks, dim=-1, keepdim=True)
        if kind is Scaling.BLOCK:
            element_scale = exact_pow2(mx_shared_exponent(block_amax, fmt), torch.float32)
            scale_out = element_scale.squeeze(-1)
        else:
            tensor_scale = nvfp4_tensor_scale(amax)
            block_scale = nvfp4_block_scale(block_amax, tensor_scale, fmt)
            element_scale = tensor_scale * block_scale
            scale_out = block_scale.squeeze(-1)
        block_noise = to_blocks(noise, scaling.block_size) if noise is not None else None
        scaled_blocks = blocks / element_scale.to(dtype)
        cast_blocks, over_blocks = cast_with_overflow(scaled_blocks, fmt, rounding, saturate, block_noise)
        q_blocks = cast_blocks * element_scale.to(dtype)
        q = from_blocks(q_blocks, v.shape)
        return _details(x, q, from_blocks(over_blocks, v.shape), scale_out, tensor_scale, amax, fmt, scaling)
    q, overflow = cast_with_overflow(scaled, fmt, rounding, saturate, noise)
    if kind is not Scaling.NONE:
        q = q * element_scale.to(dtype)
    return _details(x, q, overflow, scale_out, tensor_scale, amax, fmt, scaling)


def _details(
    x: Tensor,
    q: Tensor,
    overflow: Tensor,
    scale: Tensor,
    tensor_scale: Tensor | None,
    amax: Tensor,
    fmt: FormatSpec,
    scaling: ScalingSpec,
) -> QuantDetails:
    values = q.to(x.dtype)
    finite = torch.isfinite(x)
    nonzero = finite & (x != 0)
    return QuantDetails(
        values=values,
        scale=scale,
        tensor_scale=tensor_scale,
        amax=amax,
        overflow_mask=overflow & finite,
        underflow_mask=nonzero & (values == 0),
        nonzero_mask=nonzero,
        nonfinite_mask=~finite,
        fmt=fmt,
        scaling=scaling,
    )


def empty_details(x: Tensor, fmt: FormatSpec, scaling: ScalingSpec) -> QuantDetails:
    """The result for an empty input: an empty copy, unit scale, zero amax, empty masks."""
    one = torch.ones((), dtype=torch.float32, device=x.device)
    empty_mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    return QuantDetails(
        values=x.detach().clone(),
        scale=one,
        tensor_scale=one if scaling.kind is Scaling.NVBLOCK else None,
        amax=torch.zeros((), dtype=torch.float32, device=x.device),
        overflow_mask=empty_mask,
        underflow_mask=empty_mask,
        nonzero_mask=empty_mask,
        nonfinite_mask=empty_mask,
        fmt=fmt,
        scaling=scaling,
    )
