"""torchao QAT: ``FakeQuantizedLinear`` and ``FakeQuantizedEmbedding`` from ``quantize_(m, QATConfig(...,
step="prepare"))``.

``weight_rel_l2`` and ``act_rel_l2`` are ``‖fq(t) − t‖ / ‖t‖`` of the layer's own ``weight_fake_quantizer`` and
``activation_fake_quantizer`` (seen by forward hooks on them: exactly the call the layer made).  The reference is the
layer's own forward with its fake quantizers switched off (``enabled = False``, restored after), in the layer's
dtype.  Gradients are not quantized by torchao QAT: ``grad`` is ``high_precision``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters.linear import ShadowedLayer
from quantwatch.agent.adapters.registry import (
    HIGH_PRECISION,
    Adapter,
    AdapterContext,
    UnsupportedLayerError,
    loaded_classes,
)
from quantwatch.agent.layers import KIND_INPUT, KIND_WEIGHT, LayerAdapter
from quantwatch.kernels import error_stats

__all__ = ["TorchAoQatAdapter", "fake_quantize_format"]

_INT_NAMES: dict[Any, str] = {torch.int8: "int8", torch.uint8: "uint8"}
_INT_NAMES.update({getattr(torch, name): name for name in ("int4", "uint4", "int2", "uint2") if hasattr(torch, name)})
_FLOAT_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def _granularity(granularity: Any) -> str:
    kind = type(granularity).__name__
    if kind == "PerGroup":
        return f"group{granularity.group_size}"
    if kind == "PerAxis":
        return "channel"
    if kind == "PerToken":
        return "token"
    if kind == "PerRow":
        return "row"
    if kind == "PerTensor":
        return "tensor"
    return kind.lower()


def fake_quantize_format(config: Any) -> str:
    """The format string of a torchao fake-quantize config (``"int4:group32"``, ``"int8:token"``,
    ``"fp8_e4m3:row"``, ``"nvfp4"``, ``"mxfp8"``); ``high_precision`` for None."""
    if config is None:
        return HIGH_PRECISION
    kind = type(config).__name__
    if kind == "NVFP4FakeQuantizeConfig":
        return "nvfp4"
    if kind == "MXFakeQuantizeConfig":
        element = {torch.float8_e4m3fn: "mxfp8", torch.float4_e2m1fn_x2: "mxfp4"}.get(config.dtype)
        return element or f"{_FLOAT_NAMES.get(config.dtype, config.dtype)}:block{config.block_size}"
    if kind == "Int4WeightFakeQuantizeConfig":
        return f"int4:group{config.group_size}"
    if kind == "Float8FakeQuantizeConfig":
        return f"{_FLOAT_NAMES.get(config.dtype, str(config.dtype))}:{_granularity(config.granularity)}"
    dtype = getattr(config, "dtype", None)
    if dtype is not None and hasattr(config, "granularity"):
        name = _INT_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        return f"{name}:{_granularity(config.granularity)}"
    return "unknown"


class TorchAoQatLayer(ShadowedLayer):
    """One torchao ``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding``."""

    def __init__(self, name: str, module: nn.Module, context: AdapterContext) -> None:
        super().__init__(name, module, context)
        self.fake_quantizers: dict[int, nn.Module] = {}
        for kind, attr in ((KIND_WEIGHT, "weight_fake_quantizer"), (KIND_INPUT, "activation_fake_quantizer")):
            fq = getattr(module, attr, None)  # an embedding has no activation fake quantizer
            if fq is not None:
                if not isinstance(fq, nn.Module) or not hasattr(fq, "enabled"):
                    raise UnsupportedLayerError(f"{attr} is a {type(fq).__name__}, not a fake quantizer with `enabled`")
                self.fake_quantizers[kind] = fq
        self._linear = isinstance(module, nn.Linear)

    def reference(self, x: Tensor) -> Tensor:
        """The module's own forward with its fake quantizers switched off."""
        saved = [(fq, fq.enabled) for fq in self.fake_quantizers.values()]
        for fq, _ in saved:
            setattr(fq, "enabled", False)  # noqa: B010 (an attribute of torchao's fake quantizers, not nn.Module)
        try:
            out = self.module.forward(x)
        finally:
            for fq, enabled in saved:
                setattr(fq, "enabled", enabled)  # noqa: B010
        if not isinstance(out, Tensor):
            raise TypeError(f"forward must return a Tensor, got {type(out).__name__}")
        return out

    def reference_weight_grad(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """``grad_outputᵀ @ x`` for a linear layer; autograd through the reference for an embedding."""
        return self._linear_weight_grad if self._linear else None

    @staticmethod
    def _linear_weight_grad(x: Tensor, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1]).T.mm(x.reshape(-1, x.shape[-1]).to(grad_output.dtype))

    def arm(self, kinds: frozenset[int]) -> None:
        """Also hook the fake quantizers whose statistics are wanted."""
        super().arm(kinds)
        for kind, fq in self.fake_quantizers.items():
            if kind in kinds:
                self._handles.append(fq.register_forward_hook(functools.partial(self._on_fake_quant, kind)))

    def _on_fake_quant(self, kind: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._in_reference or not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
            return
        self._guard("fake_quant_stats", self._record, kind, args[0], output)

    def _record(self, kind: int, x: Tensor, q: Tensor) -> None:
        if q is x:  # a fake quantizer the user switched off
            return
        self.record(kind, error_stats(x.detach(), q.detach()))


class TorchAoQatAdapter(Adapter):
    """torchao QAT ``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding`` (any fake-quantize config with an
    ``enabled`` switch: int4/int8 ``IntxFakeQuantizeConfig``, ``Float8FakeQuantizeConfig``,
    ``Int4WeightFakeQuantizeConfig``)."""

    name = "torchao.qat"

    def recognises(self, module: nn.Module) -> bool:
        """An instance of torchao's fake-quantized linear or embedding."""
        classes = loaded_classes(
            "torchao.quantization.qat.linear:FakeQuantizedLinear",
            "torchao.quantization.qat.embedding:FakeQuantizedEmbedding",
        )
        return isinstance(module, classes)

    def formats(self, module: nn.Module) -> dict[str, str]:
        """From the fake quantizers' configs; a switched-off fake quantizer (``enabled = False``) is high precision."""
        weight = getattr(module, "weight_fake_quantizer", None)
        activation = getattr(module, "activation_fake_quantizer", None)
        return {
            "weight": fake_quantize_format(getattr(weight, "config", None) if getattr(weight, "enabled", 1) else None),
            "input": fake_quantize_format(
                getattr(activation, "config", None) if getattr(activation, "enabled", 1) else None
            ),
            "grad": HIGH_PRECISION,
        }

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy's fake quantizers are switched off."""
        for attr in ("weight_fake_quantizer", "activation_fake_quantizer"):
            fq = getattr(module, attr, None)
            if fq is not None:
                setattr(fq, "enabled", False)  # noqa: B010

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer hooking the layer's fake quantizers."""
        if not hasattr(module, "weight_fake_quantizer"):
            raise UnsupportedLayerError("no weight_fake_quantizer attribute (a newer torchao renamed it?)")
        return TorchAoQatLayer(name, module, context)
