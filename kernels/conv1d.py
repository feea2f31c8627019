"""`QuantConv1D`: the quantized drop-in for transformers' ``Conv1D`` (GPT-2 family), recognised without importing
transformers.

``transformers.pytorch_utils.Conv1D(nf, nx)`` holds its weight as ``(in, out) = (nx, nf)`` and computes
``x @ W + b``: a Linear whose weight is the transpose.  `QuantConv1D` keeps that ``(in, out)`` Parameter (so an
optimizer built before the conversion keeps updating it, and checkpoints keep their shapes) and quantizes its
transpose, so scaling runs along the output rows and blocks along the input dimension exactly as for a Linear.
"""

from __future__ import annotations

from typing import Unpack

from torch import Tensor, nn

from .layers import LayerSpecs, QuantLinear

__all__ = ["CONV1D_CLASS_PATH", "QuantConv1D", "is_conv1d"]

CONV1D_CLASS_PATH = "transformers.pytorch_utils.Conv1D"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) transformers' ``Conv1D``, by class path: transformers need not be
    installed, and is not imported."""
    return any(f"{cls.__module__}.{cls.__qualname__}" == CONV1D_CLASS_PATH for cls in type(module).__mro__)


class QuantConv1D(QuantLinear):
    """A `QuantLinear` whose ``weight`` Parameter is stored ``(in_features, out_features)`` like ``Conv1D``'s.

    Forward, reference forward and quantization see ``weight.T`` (`linear_weight`); gradients reach the Parameter in
    its own shape, and `reference_weight_grad` returns that shape too."""

    @classmethod
    def from_conv1d(cls, conv: nn.Module, **specs: Unpack[LayerSpecs]) -> QuantConv1D:
        """A QuantConv1D that takes over ``conv``'s own Parameter objects (an existing optimizer keeps working)."""
        if not is_conv1d(conv):
            raise TypeError(f"conv must be a transformers Conv1D, got {type(conv).__name__}")
        conv_weight = conv.weight
        conv_bias = conv.bias
        if not isinstance(conv_weight, nn.Parameter) or conv_weight.dim() != 2:
            raise ValueError(f"a Conv1D weight must be a 2-D (in, out) Parameter, got {type(conv_weight).__name__}")
        if conv_bias is not None and not isinstance(conv_bias, nn.Parameter):
            raise ValueError(f"a Conv1D bias must be a Parameter or None, got {type(conv_bias).__name__}")
        in_features, out_features = conv_weight.shape
        return cls._adopt(conv, (int(in_features), int(out_features)), (conv_weight, conv_bias), specs)

    def linear_weight(self) -> Tensor:
        """``weight.T``: the ``(out, in)`` view ``F.linear`` takes."""
        return self.weight.t()

    def reference_weight_grad(self, input: Tensor, grad_output: Tensor) -> Tensor:
        """The FP32 shadow's gradient of the ``(in, out)`` Parameter: ``inputᵀ @ grad_output`` over every leading
        dimension."""
        return input.reshape(-1, self.in_features).T.mm(grad_output.reshape(-1, self.out_features))

    def extra_repr(self) -> str:
        """QuantLinear's description, saying the weight is stored transposed."""
        return f"{super().extra_repr()}, weight_layout=(in, out)"
