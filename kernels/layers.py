"""`QuantLinear`: an ``nn.Linear`` drop-in that trains with FP32 master weights and fake-quantized tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self, TypedDict, Unpack

import torch
from torch import Tensor, nn
from torch.nn.functional import linear

from .quantizer import Quantizer, QuantSpec, straight_through
from .stats import ErrorStats, StatsBatch

Observer = Callable[[str, ErrorStats], None]

DEFAULT_WEIGHT = QuantSpec("fp8_e4m3")
DEFAULT_INPUT = QuantSpec("fp8_e4m3")
DEFAULT_GRAD = QuantSpec("fp8_e5m2")


class LayerSpecs(TypedDict, total=False):
    """The specs of a layer's weight, input and output gradient, as the ``from_…`` constructors take them: a key
    left out takes the layer's default (``DEFAULT_WEIGHT``, ``DEFAULT_INPUT``, ``DEFAULT_GRAD``), ``None`` leaves
    that tensor unquantized."""

    weight: QuantSpec | None
    input: QuantSpec | None
    grad: QuantSpec | None


class QuantLinear(nn.Linear):
    """``nn.Linear`` with fake-quantized weight, input activation and output gradient (each its own `QuantSpec`).

    The parameters stay FP32 master weights; the forward uses ``Q_w(weight)`` and ``Q_in(input)`` with a
    straight-through estimator, and the backward quantizes the output gradient with ``Q_grad`` before it flows into
    the matmul's backward. A spec of ``None`` leaves that tensor unquantized.

    ``observer``: None (default, no extra work) or a callable the agent sets on sampled steps; the layer then calls
    ``observer("weight", stats)`` and ``observer("input", stats)`` during forward and ``observer("grad", stats)``
    during backward, with the fused `ErrorStats` of the quantization it just did (tensors on the device, no sync).
    The observer seen at forward time is the one used for that step's backward. Exceptions from the observer
    propagate; the agent's observer must not raise. ``stats_batch``: None (default) or a `StatsBatch` that the
    observed weight and gradient quantizations collect into, so that the statistics of CPU tensors are computed
    together when the batch is flushed (the observer then receives them before they are filled; see `StatsBatch`);
    the input's are computed at once (a caller may change the input in place right after the forward).

    `reference_forward` computes the FP32 shadow output of the same weights and bias without any quantization, and
    `reference_weight_grad` that shadow's weight gradient.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        weight: QuantSpec | None = DEFAULT_WEIGHT,
        input: QuantSpec | None = DEFAULT_INPUT,
        grad: QuantSpec | None = DEFAULT_GRAD,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight_quantizer = Quantizer(weight, generator)
        self.input_quantizer = Quantizer(input, generator)
        self.grad_quantizer = Quantizer(grad, generator)
        self.observer: Observer | None = None
        self.stats_batch: StatsBatch | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **specs: Unpack[LayerSpecs]) -> QuantLinear:
        """A QuantLinear that takes over ``linear``'s own Parameter objects (an existing optimizer keeps working)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        shape = (linear.in_features, linear.out_features)
        return cls._adopt(linear, shape, (linear.weight, linear.bias), specs)

    @classmethod
    def _adopt(
        cls,
        source: nn.Module,
        shape: tuple[int, int],
        params: tuple[Tensor, nn.Parameter | None],
        specs: LayerSpecs,
    ) -> Self:
        """A layer of ``shape`` ``(in_features, out_features)``, built without memory, that takes over ``params``
        (weight, bias: the same Parameter objects) and ``source``'s training mode."""
        weight, bias = params
        layer = cls(shape[0], shape[1], bias is not None, **specs, device="meta")
        layer.weight = weight
        layer.register_parameter("bias", bias)  # None too: a layer without bias
        layer.train(source.training)
        return layer

    def forward(self, input: Tensor) -> Tensor:
        """Quantized linear: ``Q_in(input) @ Q_w(weight).T + bias``, gradient of the output quantized by ``Q_grad``."""
        observer = self.observer
        if observer is None:
            weight = self.weight_quantizer(self.linear_weight())
            x = self.input_quantizer(input)
        else:
            weight = self._observed(self.weight_quantizer, self.linear_weight(), "weight", observer, self.stats_batch)
            # The input's statistics are taken at once, not batched: the caller may change it in place as soon as this
            # forward returns (``x += layer(x)``), long before a flush.
            x = self._observed(self.input_quantizer, input, "input", observer, None)
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        out = linear(x, weight, self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype))
        if self.grad_quantizer.enabled and out.requires_grad:
            observed = None if observer is None else (observer, self.stats_batch)
            out = _QuantizeGradient.apply(out, self.grad_quantizer, observed)  # type: ignore[no-untyped-call]
        return out

    def linear_weight(self) -> Tensor:
        """The weight as ``F.linear`` takes it, ``(out_features, in_features)``: the Parameter itself here, a view of
        it in subclasses that store it otherwise (`QuantConv1D`). Quantization scales along its rows and blocks."""
        return self.weight

    @staticmethod
    def _observed(quantizer: Quantizer, t: Tensor, role: str, observer: Observer, batch: StatsBatch | None) -> Tensor:
        if not quantizer.enabled:
            return t
        sink: list[ErrorStats] = []
        if batch is None:
            q = straight_through(t, quantizer, sink)
        else:
            with batch.collecting():
                q = straight_through(t, quantizer, sink)
        observer(role, sink[0])
        return q

    def reference_forward(self, input: Tensor) -> Tensor:
        """The FP32 shadow: ``input @ weight.T + bias``, same Parameters, no quantization (differentiable)."""
        return linear(input, self.linear_weight(), self.bias)

    def reference_weight_grad(self, input: Tensor, grad_output: Tensor) -> Tensor:
        """The FP32 shadow's weight gradient for ``input`` and output gradient ``grad_output``.

        ``grad_outputᵀ @ input`` summed over every leading dimension, as one matmul: what autograd through
        `reference_forward` gives, without building its graph (about half its cost on the CPU)."""
        return grad_output.reshape(-1, self.out_features).T.mm(input.reshape(-1, self.in_features))

    def extra_repr(self) -> str:
        """nn.Linear's description plus whether an observer is attached."""
        return f"{super().extra_repr()}, observed={self.observer is not None}"


class _QuantizeGradient(torch.autograd.Function):
    """Identity forward; backward fake-quantizes the output gradient and reports its statistics."""

    @staticmethod
    def forward(
        ctx: Any, out: Tensor, quantizer: Quantizer, observed: tuple[Observer, StatsBatch | None] | None
    ) -> Tensor:
        ctx.quantizer = quantizer
        ctx.observed = observed
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        quantizer: Quantizer = ctx.quantizer
        observed: tuple[Observer, StatsBatch | None] | None = ctx.observed
        if observed is None:
            return quantizer.quantize(grad)[0], None, None
        observer, batch = observed
        if batch is None:
            q, stats = quantizer.quantize(grad, with_stats=True)
        else:
            with batch.collecting():
                q, stats = quantizer.quantize(grad, with_stats=True)
        if stats is not None:
            observer("grad", stats)
        return q, None, None
