"""The public `quantize` entry point: validates its arguments, picks a backend, falls back to the reference."""

from __future__ import annotations

import logging
from typing import Literal, overload

import torch
from torch import Tensor

from . import compiled, native, triton_path
from .formats import FormatSpec, resolve_format
from .options import (
    Backend,
    BackendUnavailableError,
    Rounding,
    Scaling,
    ScalingSpec,
    parse_backend,
    parse_rounding,
    parse_scaling,
)
from .reference import QuantDetails, check_input, draw_noise, quantize_reference
from .stats import ErrorStats, stats_from_masks

log = logging.getLogger(__name__)

# Below this many elements torch.compile's first-call cost (seconds) outweighs any gain, so `auto` stays eager.
AUTO_COMPILE_MIN_NUMEL = 1 << 20
# The native kernels cost one build per machine (about a second, then cached on disk) and beat the reference at
# every size (a 16-element call ~0.1 ms against ~0.3 ms), so `auto` takes them for any CPU tensor they support.
AUTO_NATIVE_MIN_NUMEL = 1

ScalingArg = str | Scaling | ScalingSpec | None


def resolve_quantization(
    fmt: str | FormatSpec, scaling: ScalingArg, rounding: str | Rounding
) -> tuple[FormatSpec, ScalingSpec, Rounding]:
    """Validate a (format, scaling, rounding) triple; a preset fixes its own scaling.

    ``scaling=None`` means the preset's scaling for presets and ``"none"`` otherwise. Raises ``ValueError`` for unknown
    names (listing the accepted ones) or a scaling that contradicts a preset.
    """
    element, preset_scaling = resolve_format(fmt)
    if preset_scaling is not None:
        preset_spec = parse_scaling(preset_scaling)
        if scaling is not None and parse_scaling(scaling) != preset_spec:
            raise ValueError(f"scaling: preset {fmt!r} fixes scaling {preset_spec}; got {scaling!r}")
        spec = preset_spec
    else:
        spec = parse_scaling("none" if scaling is None else scaling)
    return element, spec, parse_rounding(rounding)


def _choose_backend(
    requested: Backend, x: Tensor, element: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool
) -> Backend:
    if requested is Backend.TRITON:
        triton_path.check_supported(x, element, spec)
        return requested
    if requested is Backend.NATIVE:
        native.check_supported(x, element, spec, rounding, saturate)
        return requested
    if requested is Backend.COMPILED:
        compiled.check_supported(x, element, spec)
        return requested
    if requested is Backend.REFERENCE:
        return requested
    if x.is_cuda and triton_path.supports(x, element, spec):
        return Backend.TRITON
    large_enough = x.numel() >= AUTO_NATIVE_MIN_NUMEL
    if large_enough and native.supports(x, element, spec, rounding, saturate) and native.available():
        return Backend.NATIVE
    return _compiled_or_reference(x, element, spec)


def _compiled_or_reference(x: Tensor, element: FormatSpec, spec: ScalingSpec) -> Backend:
    """`auto`'s choice past the native kernels (and for the tensors they decline): compiled when large enough."""
    if x.numel() >= AUTO_COMPILE_MIN_NUMEL and compiled.supports(x, element, spec):
        return Backend.COMPILED
    return Backend.REFERENCE


@overload
def quantize(
    x: Tensor,
    fmt: str | FormatSpec,
    scaling: ScalingArg = ...,
    rounding: str | Rounding = ...,
    saturate: bool = ...,
    generator: torch.Generator | None = ...,
    backend: str | Backend = ...,
    return_details: Literal[False] = ...,
    with_stats: Literal[False] = ...,
    *,
    scale: Tensor | None = ...,
    out: Tensor | None = ...,
) -> Tensor: ...
@overload
def quantize(
    x: Tensor,
    fmt: str | FormatSpec,
    scaling: ScalingArg = ...,
    rounding: str | Rounding = ...,
    saturate: bool = ...,
    generator: torch.Generator | None = ...,
    backend: str | Backend = ...,
    return_details: Literal[False] = ...,
    *,
    with_stats: Literal[True],
    scale: Tensor | None = ...,
    out: Tensor | None = ...,
) -> tuple[Tensor, ErrorStats]: ...
@overload
def quantize(
    x: Tensor,
    fmt: str | FormatSpec,
    scaling: ScalingArg = ...,
    rounding: str | Rounding = ...,
    saturate: bool = ...,
    generator: torch.Generator | None = ...,
    backend: str | Backend = ...,
    *,
    return_details: Literal[True],
    with_stats: Literal[False] = ...,
    scale: Tensor | None = ...,
    out: Tensor | None = ...,
) -> QuantDetails: ...
@overload
def quantize(
    x: Tensor,
    fmt: str | FormatSpec,
    scaling: ScalingArg = ...,
    rounding: str | Rounding = ...,
    saturate: bool = ...,
    generator: torch.Generator | None = ...,
    backend: str | Backend = ...,
    *,
    return_details: Literal[True],
    with_stats: Literal[True],
    scale: Tensor | None = ...,
    out: Tensor | None = ...,
) -> tuple[QuantDetails, ErrorStats]: ...
def quantize(
    x: Tensor,
    fmt: str | FormatSpec,
    scaling: ScalingArg = None,
    rounding: str | Rounding = "nearest",
    saturate: bool = True,
    generator: torch.Generator | None = None,
    backend: str | Backend = "auto",
    return_details: bool = False,
    with_stats: bool = False,
    *,
    scale: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor | QuantDetails | tuple[Tensor, ErrorStats] | tuple[QuantDetails, ErrorStats]:
    """Fake-quantize ``x`` to a format: the result has ``x``'s shape and dtype and holds only format values × scales.

    ``fmt``: ``fp8_e4m3, fp8_e5m2, fp6_e3m2, fp6_e2m3, fp4_e2m1, fp4_e1m2, int8, int4, e8m0`` or a preset
    ``mxfp8, mxfp6, mxfp4, nvfp4`` (which fixes its scaling). ``scaling``: ``"none"`` (default for formats),
    ``"tensor"``, ``"tensor:pow2"``, ``"channel"``/``"channel:AXIS"``, ``"block:N"`` (E8M0 shared scales, OCP MX),
    ``"nvblock:N"`` (NVFP4 two-level), ``"delayed:N[:MARGIN]"`` (stateless here: the current amax stands in for the
    history; `Quantizer` keeps the real history). ``rounding``: ``"nearest"`` (ties to even) or ``"stochastic"``
    (draws from ``generator``). ``saturate``: clamp overflow to ±max (else overflow becomes inf/NaN where the format
    has them). ``backend``: ``auto``/``reference``/``compiled``/``native``/``triton`` (`Backend`); an explicit fast
    backend that cannot run raises `BackendUnavailableError`. ``scale``: a precomputed per-tensor dequantization
    scale for ``tensor``/``delayed`` scaling. ``out``: a tensor of ``x``'s shape, dtype and device that receives the
    values and is returned (``x`` itself quantizes in place); reusing one saves allocating, and on the CPU
    page-faulting, a fresh copy per call, which costs as much as the quantization itself on large tensors.

    Returns the tensor; with ``with_stats=True`` also its `ErrorStats` (one fused pass on the fast backends); with
    ``return_details=True`` a `QuantDetails` (values, scales, masks) computed by the reference in place of the tensor.
    Raises ``TypeError`` for a non-float ``x`` and ``ValueError`` for unknown names.
    """
    check_input(x)
    element, spec, rounding_mode = resolve_quantization(fmt, scaling, rounding)
    requested = parse_backend(backend)
    if scale is not None and spec.kind not in (Scaling.TENSOR, Scaling.DELAYED):
        raise ValueError(f"scale: a precomputed scale needs tensor or delayed scaling, not {spec}")
    if out is not None:
        _check_out(out, x, return_details)
    if return_details:
        if requested not in (Backend.AUTO, Backend.REFERENCE):
            raise BackendUnavailableError("return_details is computed by the reference backend only")
        details = quantize_reference(x, element, spec, rounding_mode, saturate, generator, scale)
        if with_stats:
            return details, reference_stats(x, details)
        return details
    values, stats = quantize_with_backend(
        x, element, spec, rounding_mode, saturate, generator, requested, with_stats, scale, out
    )[:2]
    if with_stats:
        if stats is None:
            raise RuntimeError("a backend returned no statistics although they were requested")
        return values, stats
    return values


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_out(out: object, x: Tensor, return_details: bool) -> None:
    if return_details:
        raise ValueError("out: return_details returns a QuantDetails; out is for the values alone")
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out: needs x's shape, dtype and device ({tuple(x.shape)}, {x.dtype}, {x.device}); "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out.requires_grad:
        raise ValueError("out: must not require grad (quantize writes it without recording the operation)")


def quantize_with_backend(
    x: Tensor,
    element: FormatSpec,
    spec: ScalingSpec,
    rounding: Rounding,
    saturate: bool,
    generator: torch.Generator | None,
    backend: Backend,
    with_stats: bool,
    scale: Tensor | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, ErrorStats | None, Tensor, Tensor]:
    """Run one quantization on the chosen backend: ``(values, stats or None, scale, amax)``; the values go into
    ``out`` when given (checked by the caller: x's shape, dtype and device).

    ``auto`` falls back to the reference (logging once) when a fast path fails to build. The native path hands the
    tensors it declines (NaN/±inf, see `native.quantize_native`) to the compiled path when they are large enough for
    `auto` to compile, else to the reference.
    """
    chosen = _choose_backend(backend, x, element, spec, rounding, saturate)
    if out is not None and _shares_memory(out, x):
        # In place: a backend may write the values before it declines (native) or defer statistics that read x
        # later (StatsBatch); both need x as it was.
        x = x.detach().clone()
    if chosen is Backend.NATIVE and x.numel() > 0:
        try:
            result = native.quantize_native(x, element, spec, rounding, saturate, scale, with_stats, out)
        except BackendUnavailableError:
            if backend is not Backend.AUTO:
                raise
            log.warning("quantwatch.kernels: native backend unavailable; using the next", exc_info=True)
            result = None
        if result is not None:
            return result
        chosen = _compiled_or_reference(x, element, spec)
    noise = None
    if rounding is Rounding.STOCHASTIC and x.numel() > 0:
        noise = draw_noise(x.shape, generator, x.device)
    result = None
    if chosen in (Backend.COMPILED, Backend.TRITON) and x.numel() > 0:
        runner = triton_path.quantize_fused if chosen is Backend.TRITON else compiled.quantize_fused
        try:
            result = runner(x, element, spec, rounding, saturate, noise, scale, with_stats)
        except BackendUnavailableError:
            if backend not in (Backend.AUTO, Backend.NATIVE):
                raise
            log.warning("quantwatch.kernels: %s backend unavailable; using the reference", chosen.value, exc_info=True)
    if result is None:
        details = quantize_reference(x, element, spec, rounding, saturate, generator, scale, noise)
        stats = reference_stats(x, details) if with_stats else None
        result = details.values, stats, details.scale, details.amax
    if out is not None:
        out.copy_(result[0])
        return out, *result[1:]
    return result


def reference_stats(x: Tensor, details: QuantDetails) -> ErrorStats:
    """`ErrorStats` of a reference quantization, reusing its masks and amax (float32, so exact unless x is float64)."""
    return stats_from_masks(
        x,
        details.values,
        details.overflow_mask,
        details.underflow_mask,
        nonzero_mask=details.nonzero_mask,
        amax=details.amax if x.dtype != torch.float64 else None,
    )
