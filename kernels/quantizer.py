"""`QuantSpec` (what to quantize to) and `Quantizer` (the module applying it, with its delayed-scaling state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .api import quantize_with_backend, resolve_quantization
from .formats import PRESETS, FormatSpec
from .options import Rounding, Scaling, ScalingSpec, parse_backend
from .reference import amax_to_scale, check_input, finite_amax
from .stats import ErrorStats, stats_from_masks


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor of a layer is quantized.

    ``fmt``: a format or preset name (see `quantize`). ``scaling``: a scaling string; ``None`` (default) resolves to
    ``"tensor"`` for formats and to the preset's own scaling for presets, and is stored resolved (``QuantSpec("mxfp4")
    .scaling == "block:32"``). ``rounding``: ``"nearest"``/``"stochastic"``. ``saturate``: clamp overflow.
    ``error_feedback``: add the previous call's quantization error back before quantizing. ``backend``: as in
    `quantize`. Invalid values raise ``ValueError`` naming the field.
    """

    fmt: str
    scaling: str | None = None
    rounding: str = "nearest"
    saturate: bool = True
    error_feedback: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        element, spec, rounding = resolve_quantization(
            self.fmt, "tensor" if self.scaling is None and not _is_preset(self.fmt) else self.scaling, self.rounding
        )
        parse_backend(self.backend)
        if not isinstance(self.saturate, bool):
            raise TypeError(f"saturate must be a bool, got {type(self.saturate).__name__}")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(self.error_feedback).__name__}")
        object.__setattr__(self, "scaling", str(spec))
        object.__setattr__(self, "rounding", rounding.value)
        object.__setattr__(self, "_resolved", (element, spec, rounding))

    @property
    def element(self) -> FormatSpec:
        """The element format (the preset's element for presets)."""
        return self._parts[0]

    @property
    def scaling_spec(self) -> ScalingSpec:
        """The parsed scaling."""
        return self._parts[1]

    @property
    def rounding_mode(self) -> Rounding:
        """The parsed rounding."""
        return self._parts[2]

    @property
    def _parts(self) -> tuple[FormatSpec, ScalingSpec, Rounding]:
        parts: tuple[FormatSpec, ScalingSpec, Rounding] = self.__dict__["_resolved"]
        return parts


def _is_preset(fmt: object) -> bool:
    return isinstance(fmt, str) and fmt.strip().lower() in PRESETS


class Quantizer(nn.Module):
    """Applies one `QuantSpec` to successive tensors and keeps the state that needs.

    Calling the module (``quantizer(x)``) fake-quantizes with a straight-through gradient. `quantize` does the same
    without autograd and optionally returns `ErrorStats` (fused, on the device). State: ``last_scale`` /
    ``last_amax`` (tensors of the most recent call, None before the first); for ``delayed:N[:MARGIN]`` scaling the
    buffers ``amax_history`` (N most recent amaxes, newest first) and ``scale`` (the dequantization scale the next
    call uses: ``max(history) / format max · 2^margin``, TransformerEngine DelayedScaling with ``amax_compute_algo=
    "max"``; the first call, with an empty history, uses its own amax); with ``error_feedback`` the buffer
    ``residual`` (``x + residual − Q(x + residual)`` of the previous call, reset when the shape changes). Statistics
    compare ``Q(x + residual)`` with ``x + residual``, the tensor actually quantized.
    """

    amax_history: Tensor
    scale: Tensor
    calls: Tensor
    residual: Tensor | None

    def __init__(self, spec: QuantSpec | None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if spec is not None and not isinstance(spec, QuantSpec):
            raise TypeError(f"spec must be a QuantSpec or None, got {type(spec).__name__}")
        self.spec = spec
        self.generator = generator
        self.last_scale: Tensor | None = None
        self.last_amax: Tensor | None = None
        if spec is not None and spec.scaling_spec.kind is Scaling.DELAYED:
            self.register_buffer("amax_history", torch.zeros(spec.scaling_spec.history))
            self.register_buffer("scale", torch.ones(()))
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("residual", None, persistent=False)

    @property
    def enabled(self) -> bool:
        """False when the spec is None (the tensor passes through unquantized)."""
        return self.spec is not None

    def forward(self, x: Tensor) -> Tensor:
        """Fake-quantize ``x`` with a straight-through gradient (identity backward); identity when disabled."""
        if self.spec is None:
            return x
        return straight_through(x, self)

    def quantize(self, x: Tensor, with_stats: bool = False) -> tuple[Tensor, ErrorStats | None]:
        """Fake-quantize ``x`` (no autograd), update the state, and return ``(q, stats or None)``."""
        check_input(x)
        if self.spec is None:
            return x, (_identity_stats(x) if with_stats else None)
        element, spec, rounding = self.spec.element, self.spec.scaling_spec, self.spec.rounding_mode
        with torch.no_grad():
            target = x.detach()
            if self.spec.error_feedback:
                residual = self.residual
                if residual is None or residual.shape != target.shape or residual.device != target.device:
                    residual = torch.zeros_like(target)
                target = target + residual.to(target.dtype)
            given_scale = self._delayed_scale(target, element, spec) if spec.kind is Scaling.DELAYED else None
            q, stats, scale, amax = quantize_with_backend(
                target,
                element,
                spec,
                rounding,
                self.spec.saturate,
                self.generator,
                parse_backend(self.spec.backend),
                with_stats,
                given_scale,
            )
            if self.spec.error_feedback:
                self.residual = target - q
            if spec.kind is Scaling.DELAYED:
                self._record_amax(amax, element, spec)
        self.last_scale = scale
        self.last_amax = amax
        return q, stats

    def _delayed_scale(self, x: Tensor, element: FormatSpec, spec: ScalingSpec) -> Tensor:
        current = amax_to_scale(
            finite_amax(x) if x.numel() else torch.zeros((), device=x.device), element, margin=spec.margin
        )
        return torch.where(self.calls > 0, self.scale, current.to(self.scale.device))

    def _record_amax(self, amax: Tensor, element: FormatSpec, spec: ScalingSpec) -> None:
        history = torch.roll(self.amax_history, 1)
        history[0] = amax.to(history.device, history.dtype)
        self.amax_history.copy_(history)
        history_amax = history.max()
        next_scale = amax_to_scale(history_amax, element, margin=spec.margin)
        # TransformerEngine keeps the previous scale when the history holds no usable amax.
        usable = (history_amax > 0) & torch.isfinite(history_amax)
        self.scale.copy_(torch.where(usable, next_scale, self.scale))
        self.calls.add_(1)

    def extra_repr(self) -> str:
        """Format, scaling and rounding, for ``print(model)``."""
        if self.spec is None:
            return "disabled"
        return f"fmt={self.spec.fmt}, scaling={self.spec.scaling}, rounding={self.spec.rounding}"


def _identity_stats(x: Tensor) -> ErrorStats:
    return stats_from_masks(x, x, None)


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantizer's fake-quantized value; backward: the gradient unchanged (STE)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, quantizer: Quantizer, sink: list[ErrorStats] | None) -> Tensor:
        q, stats = quantizer.quantize(x, with_stats=sink is not None)
        if sink is not None and stats is not None:
            sink.append(stats)
        return q

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


def straight_through(x: Tensor, quantizer: Quantizer, sink: list[ErrorStats] | None = None) -> Tensor:
    """Fake-quantize ``x`` with an identity gradient; append the fused statistics to ``sink`` when it is a list."""
    result: Tensor = _StraightThrough.apply(x, quantizer, sink)  # type: ignore[no-untyped-call]
    return result
