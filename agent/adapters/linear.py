"""A linear layer whose casts the agent recomputes from the layer's own configuration: the common measurer of the
torchao adapters.

Dynamic scaling is deterministic, so casting the tensor the layer cast, with the layer's own settings, gives the
very values the layer computed with.  On a sampled step a forward hook recomputes the weight cast (once per step)
and the input cast, and a pre-hook on the output's autograd node the output-gradient cast; the statistics compare
each dequantized cast with its high-precision tensor.  The reference is ``F.linear(x, W, b)`` in the reference
dtype (FP32 by default) with autocast off, and its weight gradient ``grad_outputᵀ @ x`` in the same dtype.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.functional import linear

from quantwatch.agent.adapters.registry import AdapterContext, loaded_classes
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_WEIGHT, _ShadowedModuleAdapter
from quantwatch.agent.shadow import REFERENCE_DTYPES
from quantwatch.kernels import ErrorStats
from quantwatch.kernels.stats import stats_from_masks

__all__ = [
    "INT8_TRAINING_WEIGHT",
    "Cast",
    "CastResult",
    "RecomputedCastLinear",
    "ShadowedLayer",
    "high_precision_data",
    "in_backward",
    "plain_linear_forward",
    "reference_dtype",
    "runs_plain_linear",
    "training_weight_classes",
]


class ShadowedLayer(_ShadowedModuleAdapter):
    """Base of a measurer with a reference forward: override ``reference(x)`` (the FP32 output for input ``x``) to
    get ``output_*`` and ``update_cosine``, optionally ``reference_weight_grad()``; extend ``arm`` with hooks that
    ``record(KIND_WEIGHT | KIND_INPUT | KIND_GRAD, error_stats(t, q))`` for the quantization error figures (append
    the hooks' handles to ``self._handles``: they are removed when the step is over)."""

    def __init__(self, name: str, module: nn.Module, context: AdapterContext) -> None:
        super().__init__(name, module, context.failures, context.clock, context.deferred)


def reference_dtype(context: AdapterContext) -> torch.dtype:
    """The torch dtype of the context's reference computation."""
    return REFERENCE_DTYPES[context.reference_dtype]


def training_weight_classes(name: str = "TrainingWeightWrapperBaseTensor") -> tuple[type, ...]:
    """A torchao training weight wrapper class (``TrainingWeightWrapperBaseTensor``: MXFP8 and float8 training wrap
    every parameter of the module in one) by name, as an ``isinstance`` tuple: empty while torchao's module is not
    loaded (no layer has one)."""
    return loaded_classes(f"torchao.prototype.moe_training.tensor:{name}")


#: torchao INT8 mixed-precision training's weight wrapper (its high-precision weight in ``_data`` too).
INT8_TRAINING_WEIGHT = (
    "torchao.prototype.quantized_training.int8_mixed_precision:Int8MixedPrecisionTrainingLinearWeight"
)


def high_precision_data(t: Tensor) -> Tensor:
    """The high-precision tensor inside a torchao training weight wrapper (MXFP8 / float8 training's, INT8
    mixed-precision training's); ``t`` itself otherwise."""
    if isinstance(t, training_weight_classes() + loaded_classes(INT8_TRAINING_WEIGHT)):
        data: Tensor = getattr(t, "_data")  # noqa: B009
        return data
    return t


def _differentiable_data(t: Tensor) -> Tensor:
    """As `high_precision_data`, through torchao's ``unwrap_weight`` (its gradient reaches the wrapper parameter)."""
    if isinstance(t, training_weight_classes()):
        from torchao.prototype.moe_training.utils import unwrap_weight

        unwrapped: Tensor = unwrap_weight(t)
        return unwrapped
    return t


def _plain_linear(module: nn.Module, x: Tensor) -> Tensor:
    weight, bias = module.weight, module.bias
    if not isinstance(weight, Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor")
    return linear(x, _differentiable_data(weight), _differentiable_data(bias) if isinstance(bias, Tensor) else None)


def plain_linear_forward(module: nn.Module) -> None:
    """Replace ``module``'s forward by ``F.linear(x, weight, bias)`` on its own parameters (the data inside a torchao
    training weight wrapper, its gradient still the wrapper's): for the shadow model, and a layer kept in high
    precision (:mod:`quantwatch.agent.precision`)."""
    # An instance attribute: nn.Module.__call__ looks `forward` up on the instance first.
    module.forward = types.MethodType(_plain_linear, module)


def runs_plain_linear(module: nn.Module) -> bool:
    """Whether `plain_linear_forward` replaced ``module``'s forward."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _plain_linear


@dataclass(frozen=True)
class CastResult:
    """One recomputed cast: the high-precision tensor as cast, its dequantized value (same shape), which elements
    were clipped at the format maximum (None: none can be) and the dequantization scale (largest, 0-dim; None when
    the cast has none to report)."""

    hp: Tensor
    dequantized: Tensor
    overflow: Tensor | None = None
    scale: Tensor | None = None

    def stats(self) -> ErrorStats:
        """The cast's error statistics."""
        return stats_from_masks(self.hp, self.dequantized, self.overflow)


#: Recomputes one of the layer's casts from the high-precision tensor.
Cast = Callable[[Tensor], CastResult]


def in_backward() -> bool:
    """Whether this thread runs a backward pass (a forward now is one activation checkpointing re-runs); False
    where torch does not say (it is asked in the layers' hooks, which must not raise)."""
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task is not None and bool(graph_task() != -1)


class RecomputedCastLinear(ShadowedLayer):
    """Measures a linear layer by recomputing its casts (``casts[kind]`` for ``KIND_WEIGHT | KIND_INPUT |
    KIND_GRAD``; a missing kind is kept in high precision: no figure).

    ``unwrap(t)`` gives the high-precision tensor of a parameter torchao wrapped (identity by default), for the
    weight cast and the reference; ``prepare_input`` what the layer does to its input before casting it (autocast)."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        context: AdapterContext,
        casts: dict[int, Cast],
        *,
        unwrap: Callable[[Tensor], Tensor] | None = None,
        prepare_input: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__(name, module, context)
        self.casts = casts
        self.dtype = reference_dtype(context)
        self._unwrap: Callable[[Tensor], Tensor] = unwrap or (lambda t: t)
        self._prepare_input: Callable[[Tensor], Tensor] = prepare_input or (lambda x: x)
        self._weight_measured = False
        self._last_scale: Tensor | None = None

    def _hp_weight(self) -> Tensor:
        weight = self.weight
        if weight is None:
            raise TypeError(f"{type(self.module).__name__} has no weight tensor")
        return self._unwrap(weight)

    def reference(self, x: Tensor) -> Tensor:
        """``F.linear(x, W, b)`` in the reference dtype, autocast off."""
        weight = self._hp_weight()
        bias = getattr(self.module, "bias", None)
        args = (
            x.to(self.dtype),
            weight.to(self.dtype),
            self._unwrap(bias).to(self.dtype) if isinstance(bias, Tensor) else None,
        )
        if not torch.is_autocast_enabled(x.device.type):
            return linear(*args)  # entering an autocast context costs more than a small layer's reference
        with torch.autocast(device_type=x.device.type, enabled=False):
            return linear(*args)

    def reference_weight_grad(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """``grad_outputᵀ @ x`` over every leading dimension, in the reference dtype."""
        return self._weight_grad

    def reference_linear(self) -> tuple[Tensor, Tensor | None] | None:
        """The high-precision weight and bias, when the reference computes in float32."""
        if self.dtype != torch.float32:
            return None
        bias = getattr(self.module, "bias", None)
        return self._hp_weight(), self._unwrap(bias) if isinstance(bias, Tensor) else None

    def _weight_grad(self, x: Tensor, grad_output: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype)
        g2 = grad_output.reshape(-1, grad_output.shape[-1]).to(self.dtype)
        return g2.T.mm(x2)

    def scale(self) -> Tensor | None:
        """The input cast's dequantization scale (largest), from the step's last forward."""
        return self._last_scale

    def arm(self, kinds: frozenset[int]) -> None:
        """Also hook the forward when cast statistics are wanted; forget the last sampled step's scale."""
        super().arm(kinds)
        self._last_scale = None
        if kinds & {KIND_WEIGHT, KIND_INPUT, KIND_GRAD}:
            self._arm_casts()

    def _arm_casts(self) -> None:
        """Hook what measuring the casts needs: a forward hook recomputing them."""
        self._handles.append(self.module.register_forward_hook(self._on_forward_casts))

    def end_step(self) -> None:
        """The weight is measured again in the next sampled step."""
        super().end_step()
        self._weight_measured = False

    def disarm(self) -> None:
        """Remove the hooks (the step's scale stays: the monitor reads it after disarming the step's adapters)."""
        super().disarm()
        self._weight_measured = False

    def _on_forward_casts(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not args or not isinstance(args[0], Tensor):
            return
        self._guard("cast_stats", self._measure_forward, args[0], output)

    def _measure_forward(self, x: Tensor, output: Any) -> None:
        if in_backward():  # a forward activation checkpointing re-runs: its casts are the first run's, measured
            self._hook_grad_output(output)
            return
        with torch.no_grad():
            weight_cast = self.casts.get(KIND_WEIGHT)
            if KIND_WEIGHT in self.kinds and weight_cast is not None and not self._weight_measured:
                self.record(KIND_WEIGHT, weight_cast(self._hp_weight().detach()).stats())
                self._weight_measured = True
            input_cast = self.casts.get(KIND_INPUT)
            if input_cast is not None and self.kinds & {KIND_INPUT}:
                result = input_cast(self._prepare_input(x.detach()))
                self.record(KIND_INPUT, result.stats())
                self._last_scale = result.scale
        self._hook_grad_output(output)

    def _hook_grad_output(self, output: Any) -> None:
        """Recompute the gradient cast when ``output``'s gradient reaches its node (a reentrant checkpoint's
        recomputed forward makes the only node that runs)."""
        grad_cast = self.casts.get(KIND_GRAD)
        if KIND_GRAD in self.kinds and grad_cast is not None and isinstance(output, Tensor):
            node = output.grad_fn
            if node is not None:
                node.register_prehook(functools.partial(self._on_grad_output, grad_cast, output.output_nr))

    def _on_grad_output(self, cast: Cast, index: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
        grad = grad_outputs[index]
        if grad is not None:
            self._guard("cast_stats", self._measure_grad, cast, grad)

    def _measure_grad(self, cast: Cast, grad: Tensor) -> None:
        with torch.no_grad():
            self.record(KIND_GRAD, cast(grad.detach()).stats())
