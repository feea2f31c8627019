"""The public `quantize` entry point: validates its arguments, picks a backend, falls back to the reference."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor

from . import compiled, native, triton_path
from .backends import FastPath, QuantRequest, QuantResult, check_supported
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
from .partial_sums import ErrorStats
from .reference import QuantDetails, check_input, draw_noise, quantize_reference
from .stats import stats_from_masks

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


@dataclass(frozen=True)
class Preference:
    """One row of `AUTO_PREFERENCE`: a fast path, the devices `auto` takes it for (None: any), the fewest elements
    worth it (read when asked: the module's thresholds), and whether a tensor it declines or fails on goes on to
    the rows below (else straight to the reference)."""

    path: FastPath
    devices: tuple[str, ...] | None
    min_numel: Callable[[], int]
    falls_through: bool


# `auto`'s fast paths, best first: the first row whose device, size, support and availability all hold runs the
# quantization. Triton for CUDA tensors; the native kernels for the CPU tensors they support (a tensor they decline
# for its values, or a failed build, moves on down); torch.compile for large tensors; else the reference.
AUTO_PREFERENCE: tuple[Preference, ...] = (
    Preference(triton_path, ("cuda",), lambda: 0, falls_through=False),
    Preference(native, ("cpu",), lambda: AUTO_NATIVE_MIN_NUMEL, falls_through=True),
    Preference(compiled, None, lambda: AUTO_COMPILE_MIN_NUMEL, falls_through=False),
)


def _plan(
    requested: Backend, x: Tensor, element: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool
) -> list[FastPath]:
    """The fast paths to try in turn (the reference after them). An explicit fast backend is checked here
    (`BackendUnavailableError` when it cannot run) and leads; `auto` takes the first row of `AUTO_PREFERENCE` that
    applies, and both continue with the rows below a row that falls through."""
    if requested is Backend.REFERENCE:
        return []
    rows = AUTO_PREFERENCE
    plan: list[FastPath] = []
    if requested is not Backend.AUTO:
        index = next(i for i, row in enumerate(rows) if row.path.NAME is requested)
        check_supported(rows[index].path, x, element, spec, rounding, saturate)
        plan.append(rows[index].path)
        rows = rows[index + 1 :] if rows[index].falls_through else ()
    for row in rows:
        if _applies(row, x, element, spec, rounding, saturate):
            plan.append(row.path)
            if not row.falls_through:
                break
    return plan


def _applies(
    row: Preference, x: Tensor, element: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool
) -> bool:
    # Availability last: it may build the native library.
    return (
        (row.devices is None or x.device.type in row.devices)
        and x.numel() >= row.min_numel()
        and row.path.unsupported_reason(x, element, spec, rounding, saturate) is None
        and row.path.available()
    )


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
) -> QuantResult:
    """Run one quantization on the chosen backend: ``(values, stats or None, scale, amax)``; the values go into
    ``out`` when given (checked by the caller: x's shape, dtype and device).

    The fast paths of `_plan` run in turn until one returns a result; ``auto`` moves on (logging) when one fails to
    build. The native path hands the tensors it declines (NaN/±inf, see `native.quantize_native`) to the compiled
    path when they are large enough for `auto` to compile, else to the reference.
    """
    plan = _plan(backend, x, element, spec, rounding, saturate)
    if x.numel() == 0:  # checked, but nothing to run: the reference's empty result
        plan = []
    if out is not None and _shares_memory(out, x):
        # In place: a backend may write the values before it declines (native) or defer statistics that read x
        # later (StatsBatch); both need x as it was.
        x = x.detach().clone()
    noise = None
    if rounding is Rounding.STOCHASTIC and x.numel() > 0:
        noise = draw_noise(x.shape, generator, x.device)
    request = QuantRequest(x, element, spec, rounding, saturate, noise, scale, with_stats, out)
    result = None
    for position, path in enumerate(plan):
        try:
            result = path.quantize(request)
        except BackendUnavailableError:
            if position == 0 and backend is not Backend.AUTO:
                raise
            then = "the next" if position + 1 < len(plan) else "the reference"
            log.warning("quantwatch.kernels: %s backend unavailable; using %s", path.NAME.value, then, exc_info=True)
        if result is not None:
            break
    if result is None:
        details = quantize_reference(x, element, spec, rounding, saturate, generator, scale, noise)
        stats = reference_stats(x, details) if with_stats else None
        result = details.values, stats, details.scale, details.amax
    if out is not None and result[0] is not out:
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
