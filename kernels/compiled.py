"""The fused CPU fast path: quantize and every error statistic in one ``torch.compile``-generated pass.

The casts (`casts`) are written independently of the reference and tested bit-exact against it. With statistics,
the first run assumes every element finite and sums without masks (float32 inputs under scalar and block scalings:
float32 products over runs of 8 inside the quantize loop, `lane_stats`); `quantize_fused` reruns the masked float64
kernels when the sums show otherwise. Each configuration (format, scaling, rounding, saturation, statistics on/off,
finite or masked) is compiled once into its own function, and Dynamo marks shapes dynamic after the first change, so
a training loop reuses the same kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.functional import pad

from .backends import QuantRequest, QuantResult, raise_if_unsupported
from .casts import (
    beyond_threshold,
    binade_exponent,
    cast,
    cast_bits,
    cast_saturating,
    element_unsupported_reason,
    nearest_overflow,
    pow2_bits,
)
from .casts import overflow_threshold as overflow_threshold  # re-exported: the overflow tests read it here
from .formats import (
    E8M0_EXPONENT_MAX,
    E8M0_EXPONENT_MIN,
    FP8_E4M3,
    NVFP4_BLOCK_SCALE_MIN,
    FormatSpec,
    Kind,
    Special,
)
from .options import Backend, BackendUnavailableError, Rounding, Scaling, ScalingSpec
from .partial_sums import ErrorStats, lane_sums_in_range, masked_float64
from .reference import from_blocks, nvfp4_tensor_scale, to_blocks

MAX_NUMEL = 1 << 31

# The all-finite statistics of scalar and block scalings sum float32 products over runs of LANE_DEPTH elements
# (one element from each of LANE_DEPTH consecutive rows of LANE_WIDTH, or of blocks), and those partial sums in
# float64: each partial is within LANE_DEPTH · 2^-24 ≈ 4.8e-7 of its exact value, while the float64 products the
# kernels replace cost two conversions and twice the vector instructions per element. That holds while no float32
# product overflows or loses much of a sum to underflow, which `lane_sums_in_range` checks on the results.
LANE_DEPTH = 8
LANE_WIDTH = 16  # one AVX-512 vector of float32
# Inductor stores a pointwise value to memory (and sums it in a second loop) once it reads more than 12 inputs or
# holds more than 50 operations; a count over LANE_DEPTH slices does both, so the lane kernels raise the limits.
INDUCTOR_OPTIONS = {"realize_cpu_acc_reads_threshold": 64, "realize_opcount_threshold": 400}


@dataclass(frozen=True)
class FusedConfig:
    """The static part of one fused quantization; each distinct value compiles its own kernels."""

    fmt: FormatSpec
    scaling: ScalingSpec
    stochastic: bool
    saturate: bool
    with_stats: bool
    given_scale: bool
    assume_finite: bool
    # All-finite statistics as float32 lanes (`uses_lanes`, `_fused_lanes`).
    lanes: bool = False


def unsupported_reason(x: Tensor, fmt: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool) -> str | None:
    """Why the compiled path cannot run this quantization, or None when it can (every scaling, rounding and
    saturation: only the dtype, the element format and the size decide)."""
    reason = element_unsupported_reason(x, fmt)
    if reason is not None:
        return reason
    if x.numel() >= MAX_NUMEL:
        return f"tensors of {MAX_NUMEL} elements or more (32-bit counts)"
    return None


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
    v: Tensor, finite_abs: Tensor, amax: Tensor, block_amax: Tensor, given: Tensor | None, config: FusedConfig
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
    element, reported, tensor_scale = _block_scales(block_amax, amax, config)
    return element, reported.squeeze(-1), tensor_scale


def fused_quantize(
    x: Tensor, noise: Tensor | None, given_scale: Tensor | None, config: FusedConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Quantize and measure in one traced graph: ``(values, stats as FIELDS vector, scale, amax, tensor scale)``.

    Eager-runnable; `quantize_fused` runs it compiled.
    """
    if config.lanes:
        return _fused_lanes(x, noise, given_scale, config)
    fmt, spec = config.fmt, config.scaling
    blocked = spec.kind in (Scaling.BLOCK, Scaling.NVBLOCK)
    v = x.to(torch.float32)
    xs = x
    if blocked:
        v = to_blocks(v, spec.block_size)
        xs = to_blocks(x, spec.block_size)
        noise = to_blocks(noise, spec.block_size) if noise is not None else None
    # Assuming every element finite, |x| needs no mask; `quantize_fused` checks the sums and reruns masked otherwise.
    finite_abs = v.abs() if config.assume_finite else torch.where(torch.isfinite(v), v.abs(), 0.0)
    # Blocked: the tensor's amax is the largest block amax, which spares Inductor a third pass over x.
    block_amax = finite_abs.amax(dim=-1, keepdim=True) if blocked else finite_abs
    amax = block_amax.amax()
    if spec.kind is Scaling.NONE:
        scaled = v
        element_scale = None
        scale_out: Tensor = torch.ones((), dtype=torch.float32, device=x.device)
        tensor_scale = None
    else:
        element_scale, scale_out, tensor_scale = _scales(v, finite_abs, amax, block_amax, given_scale, config)
        scaled = v / element_scale
    if noise is None:
        q = cast(scaled, fmt, config.saturate, None)
        # The overflow mask from the input side; the cast's own mask made Inductor store it and re-read it in a
        # second pass for NVFP4.
        overflow = nearest_overflow(scaled, fmt)
    else:
        q, overflow = cast_bits(scaled, fmt, config.saturate, noise)
    if element_scale is not None:
        q = q * element_scale
    values = q.to(x.dtype)
    if not config.with_stats:
        stats = torch.zeros(len(ErrorStats.FIELDS), dtype=torch.float64, device=x.device)
    elif config.assume_finite:
        stats = _finite_stats_vector(xs, values, overflow, amax, x.numel())
    else:
        stats = _stats_vector(xs, values, overflow, amax, x.numel())
    if blocked:
        values = from_blocks(values, x.shape)
    return values, stats, scale_out, amax, tensor_scale


LANE_KINDS = (Scaling.NONE, Scaling.TENSOR, Scaling.DELAYED, Scaling.BLOCK, Scaling.NVBLOCK)


def uses_lanes(x: Tensor, spec: ScalingSpec, with_stats: bool) -> bool:
    """Whether the all-finite statistics run as float32 lanes (`_fused_lanes`): float32 input, scalar or block scaling.

    16-bit inputs keep the float64 sums: Inductor feeds the statistics the float32 values it stored as 16-bit ones,
    without the rounding, when the store and the sums share a loop.
    """
    return with_stats and x.dtype == torch.float32 and spec.kind in LANE_KINDS


def lanes(t: Tensor, width: int) -> list[Tensor]:
    """Flat ``t`` (numel a multiple of ``LANE_DEPTH · width``) as LANE_DEPTH strided slices of shape (rows, width):
    slice k holds row k of every group of LANE_DEPTH consecutive rows, so adding the slices sums runs of LANE_DEPTH.
    """
    runs = t.reshape(-1, LANE_DEPTH, width)
    return [runs[:, k, :] for k in range(LANE_DEPTH)]


def _run_sum(terms: list[Tensor]) -> Tensor:
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _run_max(terms: list[Tensor]) -> Tensor:
    largest = terms[0]
    for term in terms[1:]:
        largest = torch.maximum(largest, term)
    return largest


def _count(masks: list[Tensor]) -> Tensor:
    # 32-bit counts (numel < 2^31, see MAX_NUMEL) are one vector add each; 64-bit ones doubled the loop.
    return _run_sum([mask.to(torch.int32) for mask in masks]).sum(dtype=torch.int32)


def lane_stats(
    xs: list[Tensor], qs: list[Tensor], overflow: list[Tensor] | None, amax: Tensor, numel: int, padded_numel: int
) -> Tensor:
    """The all-finite statistics (`ErrorStats.FIELDS` order, float64) of float32 lanes of x and q (see `lanes`).

    Σx², Σq², Σqx and Σ(q−x)² add float32 products over runs of LANE_DEPTH, then the runs in float64; Σx², Σq² and
    Σqx take the same products in the same order, so q == ±x gives a cosine of exactly ±1. ``amax`` is the largest
    |x|; ``overflow`` masks the clipped inputs (None: none can be). A finite zero always quantizes to zero, so the
    underflows are the zeros of q less those of x, both over the ``padded_numel`` elements the lanes hold (the
    padding is zeros). Valid when `lane_sums_in_range` holds for the result.
    """
    errors = [q - x for q, x in zip(qs, xs, strict=True)]
    f64 = torch.float64
    sums = torch.stack(
        [
            _run_sum([x * x for x in xs]).to(f64).sum(),
            _run_sum([q * q for q in qs]).to(f64).sum(),
            _run_sum([q * x for q, x in zip(qs, xs, strict=True)]).to(f64).sum(),
            _run_sum([e * e for e in errors]).to(f64).sum(),
        ]
    )
    # In float32 the largest |q − x| is the float64 one rounded once (rounding is monotonic): within 2^-24.
    max_err = _run_max([e.abs() for e in errors]).amax()
    nonzero = _count([x != 0 for x in xs])
    zeros_q = _count([q == 0 for q in qs])
    clipped = _count(overflow) if overflow is not None else torch.zeros((), dtype=torch.int32, device=amax.device)
    counts = torch.stack([nonzero, zeros_q - (padded_numel - nonzero), clipped])
    return torch.cat(
        [
            torch.full((1,), numel, dtype=f64, device=amax.device),
            sums,
            torch.stack([max_err, amax]).to(f64),
            counts.to(f64),
            torch.zeros(1, dtype=f64, device=amax.device),
        ]
    )


def _lanecast(
    scaled: list[Tensor], noise: list[Tensor] | None, config: FusedConfig, may_clip: bool
) -> tuple[list[Tensor], list[Tensor] | None]:
    fmt = config.fmt
    if noise is not None:
        pairs = [cast_bits(s, fmt, config.saturate, n) for s, n in zip(scaled, noise, strict=True)]
        return [q for q, _ in pairs], [over for _, over in pairs]
    if fmt.kind is Kind.FLOAT and (config.saturate or fmt.special is Special.NONE):
        return [cast_saturating(s, fmt, may_clip) for s in scaled], [
            beyond_threshold(s, fmt) for s in scaled
        ] if may_clip else None
    return [cast(s, fmt, config.saturate, None) for s in scaled], [nearest_overflow(s, fmt) for s in scaled]


def _fused_lanes(
    x: Tensor, noise: Tensor | None, given_scale: Tensor | None, config: FusedConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """`fused_quantize` for `uses_lanes` configurations: one loop quantizes LANE_DEPTH slices of runs (stacked back
    into the output in place) and sums their statistics, so neither x nor q is read again for them."""
    fmt, spec = config.fmt, config.scaling
    blocked = spec.kind in (Scaling.BLOCK, Scaling.NVBLOCK)
    width = spec.block_size if blocked else LANE_WIDTH
    padded = padded_flat(x, spec, width)
    xs = [t.to(torch.float32) for t in lanes(padded, width)]
    noise_lanes = lanes(padded_flat(noise, spec, width), width) if noise is not None else None
    tensor_scale = None
    if blocked:
        # Block amaxes and scales in one loop over all blocks (a loop per lane would read x with a stride), then
        # sliced into lanes like x.
        block_amax = padded.reshape(-1, width).to(torch.float32).abs().amax(dim=-1, keepdim=True)
        amax = block_amax.amax()
        element, reported, tensor_scale = _block_scales(block_amax, amax, config)
        scales: list[Tensor] | None = lanes(element.reshape(-1), 1)
        block_shape = to_blocks(x, spec.block_size).shape
        scale_out = reported.reshape(-1)[: block_shape[:-1].numel()].reshape(block_shape[:-1])
        # An MX block's largest |x / scale| lies in [2^emax, 2^(emax+1)), past the maximum. An NVFP4 block scale is
        # a normal E4M3 value (at least 2^-6) within 2^-4 of (block amax / 6) / tensor scale, or above it, so
        # |x / scale| stays below 6 · 16/15 · (1 + 2^-21) < 7, where rounding would first pass 6: nothing clips.
        may_clip = spec.kind is Scaling.BLOCK
    else:
        amax = _run_max([t.abs() for t in xs]).amax()
        if spec.kind is Scaling.NONE:
            scales = None
            scale_out = torch.ones((), dtype=torch.float32, device=x.device)
            may_clip = True
        else:
            scale = given_scale if given_scale is not None else _tensor_scale(amax, fmt, spec)
            scales = [scale] * LANE_DEPTH
            scale_out = scale
            # A scale taken from the amax (and not shrunk by a negative margin) keeps every |x / scale| within the
            # maximum, up to rounding: nothing clips, so neither clamp nor overflow count is needed.
            may_clip = given_scale is not None or spec.margin < 0
    scaled = xs if scales is None else [t / s for t, s in zip(xs, scales, strict=True)]
    qs, overflow = _lanecast(scaled, noise_lanes, config, may_clip)
    if scales is not None:
        qs = [q * s for q, s in zip(qs, scales, strict=True)]
    values_lanes = [q.to(x.dtype) for q in qs]
    stacked = torch.stack(values_lanes, dim=1).reshape(-1)
    if blocked:
        values = from_blocks(stacked[: block_shape.numel()].reshape(block_shape), x.shape)
    else:
        values = stacked[: x.numel()].reshape(x.shape)
    q_lanes = [v.to(torch.float32) for v in values_lanes]
    stats = lane_stats(xs, q_lanes, overflow, amax, x.numel(), LANE_DEPTH * xs[0].numel())
    return values, stats, scale_out, amax, tensor_scale


def padded_flat(t: Tensor, spec: ScalingSpec, width: int) -> Tensor:
    """``t``'s blocks under a block scaling (a partial last block zero-padded), else ``t``, flattened and zero-padded
    to whole groups of LANE_DEPTH rows of ``width`` (what `lanes` takes)."""
    flat = (to_blocks(t, spec.block_size) if spec.kind in (Scaling.BLOCK, Scaling.NVBLOCK) else t).reshape(-1)
    padding = -flat.numel() % (LANE_DEPTH * width)
    return pad(flat, (0, padding)) if padding else flat


def _block_scales(block_amax: Tensor, amax: Tensor, config: FusedConfig) -> tuple[Tensor, Tensor, Tensor | None]:
    """(element scale, scale to report, NVFP4 tensor scale) of blocks from their amaxes, as `_scales` does."""
    fmt = config.fmt
    if config.scaling.kind is Scaling.BLOCK:
        shared = (binade_exponent(block_amax) - fmt.emax).clamp(E8M0_EXPONENT_MIN, E8M0_EXPONENT_MAX)
        scale = pow2_bits(shared)
        return scale, scale, None
    tensor_scale = nvfp4_tensor_scale(amax)
    raw = (block_amax / fmt.max_value) / tensor_scale
    block_scale = cast_bits(raw.clamp(NVFP4_BLOCK_SCALE_MIN, FP8_E4M3.max_value), FP8_E4M3, True, None)[0]
    return tensor_scale * block_scale, block_scale, tensor_scale


def _stats_vector(x: Tensor, q: Tensor, overflow: Tensor, amax: Tensor, numel: int) -> Tensor:
    # Sums accumulate in float64 like the reference. Finiteness is recomputed here rather than shared with the amax
    # pass (sharing it made Inductor materialise the mask and re-read it in an extra, slow loop), and the amax pass's
    # result is reused for the ``amax`` field.
    finite_x, finite_q, xv, qv, err = masked_float64(x, q)
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


def _finite_stats_vector(x: Tensor, q: Tensor, overflow: Tensor, amax: Tensor, numel: int) -> Tensor:
    # `_stats_vector` for tensors whose x and q are all finite, without masks: float64 squares of float32 values
    # cannot overflow, so the sums are finite exactly when every element is, which `quantize_fused` checks.
    xd = x.to(torch.float64)
    qd = q.to(torch.float64)
    err = qd - xd
    sums = torch.stack([(xd * xd).sum(), (qd * qd).sum(), (qd * xd).sum(), (err * err).sum()])
    # In float32 the largest |q − x| is the float64 one rounded once (rounding is monotonic): within 2^-24.
    max_err = (q.to(torch.float32) - x.to(torch.float32)).abs().amax()
    # 32-bit counts (numel < 2^31, see MAX_NUMEL) are one vector add each; 64-bit ones doubled the loop. A finite
    # zero always quantizes to zero, so the underflows are the zeros of q less those of x (both counted over x's
    # blocks, padding included).
    nonzero = (x != 0).sum(dtype=torch.int32)
    zeros_q = (q == 0).sum(dtype=torch.int32)
    counts = torch.stack([nonzero, zeros_q - (x.numel() - nonzero), overflow.sum(dtype=torch.int32)])
    return torch.cat(
        [
            torch.full((1,), numel, dtype=torch.float64, device=x.device),
            sums,
            torch.stack([max_err, amax]).to(torch.float64),
            counts.to(torch.float64),
            torch.zeros(1, dtype=torch.float64, device=x.device),
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


def _fast_stats_hold(stats: Tensor, config: FusedConfig) -> bool:
    # Some x or q is NaN or infinite when the float64 sums are not finite; the float32 runs have their own range.
    if config.lanes:
        return lane_sums_in_range(stats.tolist())
    return bool(torch.isfinite(stats[1] + stats[2]))


def quantize_fused(request: QuantRequest) -> QuantResult:
    """Run the compiled fused quantization: ``(values, stats or None, scale, amax)``.

    Raises `BackendUnavailableError` when this quantization is unsupported or torch.compile cannot build it.
    """
    x, fmt, spec, rounding, saturate = request.x, request.fmt, request.spec, request.rounding, request.saturate
    noise, scale, with_stats = request.noise, request.scale, request.with_stats
    raise_if_unsupported(NAME, unsupported_reason(x, fmt, spec, rounding, saturate))
    config = FusedConfig(
        fmt,
        spec,
        rounding is Rounding.STOCHASTIC,
        saturate,
        with_stats,
        scale is not None,
        with_stats,
        uses_lanes(x, spec, with_stats),
    )
    given = scale.to(device=x.device, dtype=torch.float32) if scale is not None else None
    try:
        values, stats, scale_out, amax, _ = compiled_for(config)(x.detach(), noise, given)
        if with_stats and not _fast_stats_hold(stats, config):
            # Some x or q is NaN or infinite: the unmasked amax and sums do not hold, so run the masked kernels.
            masked = dataclasses.replace(config, assume_finite=False, lanes=False)
            values, stats, scale_out, amax, _ = compiled_for(masked)(x.detach(), noise, given)
    except (RuntimeError, OSError, ImportError) as error:
        raise BackendUnavailableError(f"torch.compile could not build the fused kernel: {error}") from error
    return values, ErrorStats.from_tensor(stats) if with_stats else None, scale_out, amax


# The `backends.FastPath` protocol, implemented by this module.
NAME = Backend.COMPILED


def available() -> bool:
    """Always True: torch.compile reports a failed build when it runs (`BackendUnavailableError`)."""
    return True


def prepare() -> None:
    """Nothing to prepare: each configuration compiles on its first call."""


def quantize(request: QuantRequest) -> QuantResult:
    """`quantize_fused` (``out`` is the caller's to fill)."""
    return quantize_fused(request)
