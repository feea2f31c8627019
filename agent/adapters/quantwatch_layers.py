"""Adapters for what QuantWatch itself and torch.ao make: modules of the reference-forward protocol (``QuantLinear``
and everything ``quantize_model`` produced), ``torch.ao`` eager QAT modules, and watched kernels."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters.registry import FORMAT_KINDS, HIGH_PRECISION, Adapter, AdapterContext
from quantwatch.agent.layers import (
    KIND_INPUT,
    KIND_OUTPUT,
    KIND_WEIGHT,
    LayerAdapter,
    ModuleAdapter,
    _first_tensor,
    _ShadowedModuleAdapter,
)
from quantwatch.kernels import PRESETS, error_stats
from quantwatch.kernels.options import Scaling

__all__ = [
    "KernelAdapter",
    "KernelEntry",
    "QatAdapter",
    "ReferenceForwardAdapter",
    "TorchAoEagerQatAdapter",
    "quantwatch_format",
]

F = TypeVar("F", bound=Callable[..., Any])


def quantwatch_format(spec: Any) -> str:
    """The format string of a QuantWatch ``QuantSpec`` (``"fp8_e4m3:tensor"``, ``"mxfp4"``, ``"int8:channel"``);
    ``high_precision`` for None."""
    if spec is None:
        return HIGH_PRECISION
    element = spec.element.name
    scaling = spec.scaling_spec
    for preset in PRESETS.values():
        if preset.element.name == element and preset.scaling == str(scaling):
            return preset.name
    if scaling.kind is Scaling.NONE:
        return str(element)
    if scaling.kind in (Scaling.BLOCK, Scaling.NVBLOCK):
        return f"{element}:{scaling.kind.value}{scaling.block_size}"
    return f"{element}:{scaling.kind.value}"


class ReferenceForwardAdapter(Adapter):
    """A module with ``reference_forward(input)`` (the reference-forward protocol: ``QuantLinear`` and friends)."""

    name = "quantwatch"

    def recognises(self, module: nn.Module) -> bool:
        """Has a callable ``reference_forward``."""
        return callable(getattr(module, "reference_forward", None))

    def formats(self, module: nn.Module) -> dict[str, str]:
        """From the ``weight_quantizer`` / ``input_quantizer`` / ``grad_quantizer`` specs, where the module has them."""
        out: dict[str, str] = {}
        for kind in FORMAT_KINDS:
            quantizer = getattr(module, f"{kind}_quantizer", None)
            out[kind] = quantwatch_format(getattr(quantizer, "spec")) if hasattr(quantizer, "spec") else "unknown"  # noqa: B009
        return out

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A :class:`~quantwatch.agent.layers.ModuleAdapter`."""
        return ModuleAdapter(name, module, context.failures, context.clock, context.deferred)


def _torch_ao_format(fq: Any) -> str:
    if fq is None:
        return HIGH_PRECISION
    dtype: Any = getattr(fq, "dtype", None)
    names: dict[Any, str] = {torch.qint8: "int8", torch.quint8: "uint8", torch.qint32: "int32"}
    element = names.get(dtype, str(dtype))
    qscheme = getattr(fq, "qscheme", None)
    per_channel = qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    return f"{element}:{'channel' if per_channel else 'tensor'}"


class TorchAoEagerQatAdapter(Adapter):
    """``torch.ao.quantization`` eager QAT modules (``weight_fake_quant`` / ``activation_post_process``).

    Their ``activation_post_process`` fake-quantizes the module's *output* activation: ``act_rel_l2`` and the
    ``input`` format describe that tensor."""

    name = "torch.ao.qat"

    def recognises(self, module: nn.Module) -> bool:
        """Carries a torch.ao ``FakeQuantizeBase`` as ``weight_fake_quant`` or ``activation_post_process``."""
        return _fake_quantizers(module) != []

    def formats(self, module: nn.Module) -> dict[str, str]:
        """From the fake quantizers' dtype and qscheme; gradients stay in high precision."""
        return {
            "weight": _torch_ao_format(getattr(module, "weight_fake_quant", None)),
            "input": _torch_ao_format(getattr(module, "activation_post_process", None)),
            "grad": HIGH_PRECISION,
        }

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A :class:`QatAdapter`."""
        return QatAdapter(name, module, context.failures, context.clock, context.deferred)


def _fake_quantizers(module: nn.Module) -> list[nn.Module]:
    from torch.ao.quantization import FakeQuantizeBase

    found: list[nn.Module] = []
    for attr in ("weight_fake_quant", "activation_post_process"):
        fq = getattr(module, attr, None)
        if isinstance(fq, FakeQuantizeBase):
            found.append(fq)
    return found


class QatAdapter(_ShadowedModuleAdapter):
    """A ``torch.ao`` QAT module: statistics from its fake quantizers, reference with them switched off.

    ``act_rel_l2`` (and the ratios, ``amax``, ``scale``) describe the module's ``activation_post_process``: in eager
    QAT that is the fake quantization of the module's output activation."""

    def _bind(self) -> None:
        self.weight_fake_quant = getattr(self.module, "weight_fake_quant", None)
        self.activation_fake_quant = getattr(self.module, "activation_post_process", None)

    def reference(self, x: Tensor) -> Tensor:
        """The module's own ``forward`` with every fake quantizer and observer inside it disabled."""
        switched = [
            (fq, fq.fake_quant_enabled.clone(), fq.observer_enabled.clone()) for fq in _fake_quantizers_all(self.module)
        ]
        for fq, _, _ in switched:
            fq.fake_quant_enabled.fill_(0)
            fq.observer_enabled.fill_(0)
        try:
            out = self.module.forward(x)
        finally:
            for fq, fake_quant, observer in switched:
                fq.fake_quant_enabled.copy_(fake_quant)
                fq.observer_enabled.copy_(observer)
        if not isinstance(out, Tensor):
            raise TypeError(f"forward must return a Tensor, got {type(out).__name__}")
        return out

    def scale(self) -> Tensor | None:
        """The activation fake quantizer's scale (largest value)."""
        fq = self.activation_fake_quant if self.activation_fake_quant is not None else self.weight_fake_quant
        scale = getattr(fq, "scale", None)
        if not isinstance(scale, Tensor) or scale.numel() == 0:
            return None
        return scale.detach().amax().to(torch.float64)

    def arm(self, kinds: frozenset[int]) -> None:
        """Also hook the fake quantizers when their statistics are wanted."""
        super().arm(kinds)
        for kind, fq in ((KIND_WEIGHT, self.weight_fake_quant), (KIND_INPUT, self.activation_fake_quant)):
            if kind in kinds and isinstance(fq, nn.Module):
                self._handles.append(fq.register_forward_hook(functools.partial(self._on_fake_quant, kind)))

    def _on_fake_quant(self, kind: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._in_reference:
            return
        x = _first_tensor(args)
        if x is None or not isinstance(output, Tensor):
            return
        self._guard("fake_quant_stats", self._record_fake_quant, kind, x, output)

    def _record_fake_quant(self, kind: int, x: Tensor, output: Tensor) -> None:
        self.record(kind, error_stats(x.detach(), output.detach()))


def _fake_quantizers_all(module: nn.Module) -> list[Any]:
    from torch.ao.quantization import FakeQuantizeBase

    return [m for m in module.modules() if isinstance(m, FakeQuantizeBase)]


class KernelEntry:
    """The registry's name for kernels wrapped with ``monitor.watch_kernel`` (they are not modules to recognise)."""

    name = "kernel"
    formats: dict[str, str] = dict.fromkeys(FORMAT_KINDS, "unknown")

    @staticmethod
    def create(name: str, context: AdapterContext) -> KernelAdapter:
        """The measurer of a watched kernel."""
        return KernelAdapter(name, context.failures, context.clock)


class KernelAdapter(LayerAdapter):
    """A quantization kernel ``q = fn(x, ...)``: on sampled steps, the error of ``q`` against ``x``.

    The statistics count as the kernel's input (``act_rel_l2``, ratios, ``amax``) and as its output deviation from the
    ideal, unquantized result ``x`` (``output_rel_l2``, ``output_cosine``, ``output_sqnr_db``)."""

    def wrap(self, fn: F) -> F:
        """``fn`` with measurement on sampled steps; one attribute check otherwise."""

        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if self.kinds:
                x = _first_tensor(args)
                if x is not None and isinstance(result, Tensor) and result.shape == x.shape:
                    self._guard("kernel_stats", self._measure, x, result)
            return result

        return watched  # type: ignore[return-value]

    def _measure(self, x: Tensor, q: Tensor) -> None:
        stats = error_stats(x.detach(), q.detach())
        if KIND_INPUT in self.kinds:
            self.record(KIND_INPUT, stats)
        if KIND_OUTPUT in self.kinds:
            self.record(KIND_OUTPUT, stats)
