"""torchao float8 training: ``torchao.float8.float8_linear.Float8Linear`` (``convert_to_float8_training``).

Each tensor can be cast twice, once per GEMM it enters (``Float8LinearConfig.cast_config_*`` and their
``*_for_grad_*`` variants; rowwise recipes scale the two along different axes).  Which cast each metric reports:

* ``weight_rel_l2``: the forward GEMM's weight cast (``cast_config_weight``), else the input-gradient GEMM's;
* ``act_rel_l2``, the ratios, ``amax``, ``scale``: the forward GEMM's input cast (``cast_config_input``), else the
  weight-gradient GEMM's (``cast_config_input_for_grad_weight``);
* ``grad_rel_l2``: the input-gradient GEMM's output-gradient cast (``cast_config_grad_output``), else the
  weight-gradient GEMM's;
* a tensor kept in high precision in both GEMMs has format ``high_precision`` and no figure.

The casts are recomputed with torchao's own ``hp_tensor_to_float8_dynamic`` on the layer's ``config`` and
``linear_mm_config`` (dynamic scaling is deterministic: the same values the layer computed with).  ``scale`` is the
dequantization scale ``1 / torchao's scale`` (largest over rows), as everywhere in QuantWatch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters.linear import Cast, CastResult, RecomputedCastLinear, plain_linear_forward
from quantwatch.agent.adapters.registry import HIGH_PRECISION, Adapter, AdapterContext, UnsupportedLayerError
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_WEIGHT, LayerAdapter

__all__ = ["Float8LinearAdapter", "float8_format"]

_FLOAT8_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def _torchao_name(dtype: torch.dtype) -> str:
    return _FLOAT8_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def float8_format(cast_config: Any) -> str | None:
    """``"fp8_e4m3:tensor"`` / ``"fp8_e4m3:row"`` for a torchao ``CastConfig``; None when its scaling is disabled."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    if cast_config.scaling_type is ScalingType.DISABLED:
        return None
    granularity = "row" if cast_config.scaling_granularity is ScalingGranularity.AXISWISE else "tensor"
    return f"{_torchao_name(cast_config.target_dtype)}:{granularity}"


def _roles(config: Any) -> dict[int, list[tuple[Any, str, int]]]:
    """Per kind, the casts the layer does in the order they are reported: (cast config, role, axiswise dim) in
    torchao's own layout (weight as ``Wᵀ``, input as given, output gradient flattened to 2-D)."""
    return {
        KIND_WEIGHT: [
            (config.cast_config_weight, "WEIGHT", 0),
            (config.cast_config_weight_for_grad_input, "WEIGHT", -1),
        ],
        KIND_INPUT: [(config.cast_config_input, "INPUT", -1), (config.cast_config_input_for_grad_weight, "INPUT", 0)],
        KIND_GRAD: [
            (config.cast_config_grad_output, "GRAD_OUTPUT", -1),
            (config.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0),
        ],
    }


def _reported(config: Any) -> dict[int, tuple[Any, str, int] | None]:
    from torchao.float8.config import ScalingType

    chosen: dict[int, tuple[Any, str, int] | None] = {}
    for kind, casts in _roles(config).items():
        enabled = [c for c in casts if c[0].scaling_type is not ScalingType.DISABLED]
        chosen[kind] = enabled[0] if enabled else None
    return chosen


def _cast(module: nn.Module, kind: int, cast_config: Any, role: str, axis: int) -> Cast:
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    config: Any = getattr(module, "config")  # noqa: B009 (torchao's attribute, untyped)
    mm_config: Any = getattr(module, "linear_mm_config")  # noqa: B009
    gemm_role = GemmInputRole[role]
    dtype = cast_config.target_dtype
    fmax = torch.finfo(dtype).max
    axiswise_dim = get_maybe_axiswise_dim(axis, cast_config.scaling_granularity)

    def cast(t: Tensor) -> CastResult:
        if kind == KIND_WEIGHT:
            t = t.t()  # torchao casts Wᵀ
        elif kind == KIND_GRAD or axis == 0:
            t = t.reshape(-1, t.shape[-1])  # torchao flattens these to 2-D before casting
        fp8 = hp_tensor_to_float8_dynamic(
            t,
            dtype,
            mm_config,
            gemm_input_role=gemm_role,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=axiswise_dim,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
        scale = fp8._scale
        dequantized = fp8.to_original_precision()
        overflow = (t.to(torch.float32) * scale).abs() > fmax
        return CastResult(t, dequantized, overflow, (1.0 / scale.to(torch.float32)).amax())

    return cast


def _autocast_input(x: Tensor) -> Tensor:
    # Float8Linear.forward casts its input to the (CUDA) autocast dtype before anything else.
    if torch.is_autocast_enabled():
        return x.to(torch.get_autocast_dtype("cuda"))
    return x


class Float8LinearAdapter(Adapter):
    """``Float8Linear`` of torchao float8 training (tensorwise, rowwise, rowwise_with_gw_hp; emulated or not)."""

    name = "torchao.float8"

    def recognises(self, module: nn.Module) -> bool:
        """An instance of ``Float8Linear`` (only when torchao's float8 module is loaded: nothing else makes one)."""
        loaded = sys.modules.get("torchao.float8.float8_linear")
        return loaded is not None and isinstance(module, loaded.Float8Linear)

    def formats(self, module: nn.Module) -> dict[str, str]:
        """The reported cast's format per kind (see the module doc)."""
        names = {KIND_WEIGHT: "weight", KIND_INPUT: "input", KIND_GRAD: "grad"}
        out: dict[str, str] = {}
        for kind, chosen in _reported(module.config).items():
            fmt = float8_format(chosen[0]) if chosen is not None else None
            out[names[kind]] = fmt or HIGH_PRECISION
        return out

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy runs ``F.linear`` on the high-precision weight."""
        plain_linear_forward(module)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer recomputing the layer's casts with torchao's ``hp_tensor_to_float8_dynamic``."""
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "linear_mm_config"):
            raise UnsupportedLayerError("no config / linear_mm_config attribute (a newer torchao renamed them?)")
        if getattr(config, "enable_fsdp_float8_all_gather", False):
            raise UnsupportedLayerError("enable_fsdp_float8_all_gather (the weight is cast before the layer sees it)")
        casts = {kind: _cast(module, kind, *chosen) for kind, chosen in _reported(config).items() if chosen is not None}
        return RecomputedCastLinear(name, module, context, casts, prepare_input=_autocast_input)
