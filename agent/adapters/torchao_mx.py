"""torchao MX and NVFP4 training (prototype): MXFP8 training of ``nn.Linear`` (``quantize_(m,
MXFP8TrainingOpConfig...)``, recognised by the weight's type), ``NVFP4Linear`` (``NVFP4TrainingConfig``) and the
MX / NVFP4 fake-quantized linears of prototype QAT.

MXFP8 training: ``weight_rel_l2`` and ``act_rel_l2`` are the forward GEMM's casts (blocks of 32 along the input
features), ``grad_rel_l2`` the input-gradient GEMM's output-gradient cast (blocks along the output features),
recomputed with torchao's torch-native ``MXTensor.to_mx`` (what ``KernelPreference.EMULATED`` runs; the CUDA/Triton
casts of ``AUTO`` compute the same values).  The weight-gradient GEMM's casts (along the tokens) are not reported;
with ``wgrad_with_hp`` that GEMM is in high precision.

``NVFP4Linear`` quantizes with a random Hadamard transform and stochastic rounding in Triton kernels: its casts are
not reproducible from outside, so only ``output_*`` and ``update_cosine`` are measured (formats are reported).
It needs a CUDA GPU with NVFP4 support; so do the prototype ``NVFP4FakeQuantizedLinear`` and every MX layer
whose kernel preference is not ``EMULATED``.

A layer of these kinds that ``qw.actions.keep_high_precision`` switched off runs ``F.linear`` on its own parameters
(:func:`~quantwatch.agent.adapters.linear.plain_linear_forward`): every kind is ``high_precision``, and only
``output_*`` and ``update_cosine`` are measured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters.linear import (
    Cast,
    CastResult,
    RecomputedCastLinear,
    high_precision_data,
    plain_linear_forward,
    runs_plain_linear,
    training_weight_classes,
)
from quantwatch.agent.adapters.registry import (
    FORMAT_KINDS,
    HIGH_PRECISION,
    Adapter,
    AdapterContext,
    UnsupportedLayerError,
    loaded_classes,
)
from quantwatch.agent.adapters.torchao_qat import fake_quantize_format
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_WEIGHT, LayerAdapter

__all__ = ["MXFP8TrainingAdapter", "NVFP4TrainingAdapter", "PrototypeQatAdapter"]

_MX_BLOCK = 32
_HIGH = dict.fromkeys(FORMAT_KINDS, HIGH_PRECISION)


def _mx_cast(scaling_mode: Any, elem_dtype: torch.dtype = torch.float8_e4m3fn, block_size: int = _MX_BLOCK) -> Cast:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    def cast(t: Tensor) -> CastResult:
        t2 = t.reshape(-1, t.shape[-1]).contiguous()
        mx = MXTensor.to_mx(t2, elem_dtype, block_size, scaling_mode, KernelPreference.EMULATED)
        # E8M0 block scales are powers of two: the dequantization scales themselves.
        scale = mx.scale.to(torch.float32).amax()
        return CastResult(t2, mx.dequantize(t2.dtype), None, scale)

    return cast


def _nvfp4_cast(use_per_tensor_scale: bool) -> Cast:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def cast(t: Tensor) -> CastResult:
        t2 = t.reshape(-1, t.shape[-1]).contiguous()
        per_tensor = per_tensor_amax_to_scale(t2.abs().max()) if use_per_tensor_scale else None
        q = NVFP4Tensor.to_nvfp4(t2, per_tensor_scale=per_tensor)
        return CastResult(t2, q.dequantize(t2.dtype), None, per_tensor)

    return cast


class MXFP8TrainingAdapter(Adapter):
    """``nn.Linear`` whose weight torchao MXFP8 training swapped for an ``MXFP8TrainingWeightWrapperTensor``."""

    name = "torchao.mxfp8_training"

    def recognises(self, module: nn.Module) -> bool:
        """A linear layer whose weight is MXFP8 training's wrapper tensor."""
        wrapper = training_weight_classes("MXFP8TrainingWeightWrapperTensor")
        return isinstance(module, nn.Linear) and isinstance(module.weight, wrapper)

    def formats(self, module: nn.Module) -> dict[str, str]:
        """MXFP8 (E4M3 elements in blocks of 32, E8M0 scales) for every kind; high precision once kept there."""
        return dict(_HIGH) if runs_plain_linear(module) else {"weight": "mxfp8", "input": "mxfp8", "grad": "mxfp8"}

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy runs ``F.linear`` on the wrapped data."""
        plain_linear_forward(module)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer recomputing the forward and input-gradient GEMMs' casts (none once kept in high precision)."""
        if runs_plain_linear(module):
            return RecomputedCastLinear(name, module, context, {}, unwrap=high_precision_data)
        config = getattr(module.weight, "config", None)
        mode = getattr(config, "scale_calculation_mode", None)
        data = getattr(module.weight, "_data", None)
        if mode is None or not isinstance(data, Tensor):
            raise UnsupportedLayerError("the weight wrapper has no config.scale_calculation_mode / _data")
        cast = _mx_cast(mode)
        casts = {KIND_WEIGHT: cast, KIND_INPUT: cast, KIND_GRAD: cast}

        return RecomputedCastLinear(name, module, context, casts, unwrap=high_precision_data)


class NVFP4TrainingAdapter(Adapter):
    """``NVFP4Linear`` of torchao NVFP4 training (needs a CUDA GPU with NVFP4 kernels)."""

    name = "torchao.nvfp4_training"

    def recognises(self, module: nn.Module) -> bool:
        """An instance of ``NVFP4Linear``."""
        classes = loaded_classes("torchao.prototype.moe_training.nvfp4_training.nvfp4_training:NVFP4Linear")
        return isinstance(module, classes)

    def formats(self, module: nn.Module) -> dict[str, str]:
        """NVFP4 for every kind (gradients with a random Hadamard transform and stochastic rounding); high precision
        once kept there."""
        return dict(_HIGH) if runs_plain_linear(module) else {"weight": "nvfp4", "input": "nvfp4", "grad": "nvfp4"}

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy runs ``F.linear``."""
        plain_linear_forward(module)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """Output and update comparisons only (the casts are randomised inside the kernels)."""
        return RecomputedCastLinear(name, module, context, {})


class PrototypeQatAdapter(Adapter):
    """``MXFakeQuantizedLinear`` / ``NVFP4FakeQuantizedLinear`` of torchao's prototype QAT: weight and input casts
    recomputed with ``MXTensor.to_mx`` / ``NVFP4Tensor.to_nvfp4`` and the layer's configs; gradients stay in high
    precision."""

    name = "torchao.qat.prototype"

    def recognises(self, module: nn.Module) -> bool:
        """An instance of one of the prototype fake-quantized linears."""
        classes = loaded_classes(
            "torchao.prototype.qat.mx:MXFakeQuantizedLinear", "torchao.prototype.qat.nvfp4:NVFP4FakeQuantizedLinear"
        )
        return isinstance(module, classes)

    def formats(self, module: nn.Module) -> dict[str, str]:
        """From the layer's ``weight_config`` and ``activation_config``; high precision once kept there."""
        if runs_plain_linear(module):
            return dict(_HIGH)
        return {
            "weight": fake_quantize_format(getattr(module, "weight_config", None)),
            "input": fake_quantize_format(getattr(module, "activation_config", None)),
            "grad": HIGH_PRECISION,
        }

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy runs ``F.linear``."""
        plain_linear_forward(module)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer recomputing the weight and input casts (none once kept in high precision)."""
        casts: dict[int, Cast] = {}
        configs = ((KIND_WEIGHT, "weight_config"), (KIND_INPUT, "activation_config"))
        for kind, attr in () if runs_plain_linear(module) else configs:
            config = getattr(module, attr, None)
            if config is None:
                raise UnsupportedLayerError(f"no {attr} attribute")
            if type(config).__name__ == "NVFP4FakeQuantizeConfig":
                casts[kind] = _nvfp4_cast(bool(config.use_per_tensor_scale))
            else:
                casts[kind] = _mx_cast(config.scaling_mode, config.dtype, config.block_size)
        return RecomputedCastLinear(name, module, context, casts)
