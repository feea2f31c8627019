"""Switching one layer's quantization off, or to another format, in place: what ``qw.actions.keep_high_precision``
does to each kind of layer the agent measures.

Nothing the optimizer, DDP or a hook holds is replaced: every parameter stays the same object (its optimizer state
with it) and so does every module.  ``format`` is None (high precision), ``"fp8"`` (E4M3 weights and inputs, E5M2
gradients, one scale per tensor: torchao's ``tensorwise`` float8 recipe), ``"fp8:tensorwise"`` (the same),
``"fp8:rowwise"`` or ``"fp8:rowwise_with_gw_hp"`` (torchao's other float8 training recipes), or a QuantWatch
format or preset name.  A switch a layer kind cannot express raises ConfigError naming ``format`` and leaves the
layer as it was (the action records it in ``monitor.failures``, naming the layer and the format).  What each kind
takes:

* QuantWatch's own layers (``QuantLinear``, what ``quantize_model`` made from a ``Recipe``): None, ``"fp8"`` /
  ``"fp8:tensorwise"`` and every QuantWatch format or preset; each tensor's ``Quantizer`` is replaced by one of the
  new format (None: unquantized).
* torchao ``Float8Linear``: None sets every cast of its ``config`` to ``ScalingType.DISABLED`` (torchao's own
  high-precision GEMMs); an ``"fp8..."`` recipe replaces ``config`` by ``Float8LinearConfig.from_recipe_name``'s
  (its ``emulate`` and ``pad_inner_dim`` kept) and ``linear_mm_config`` as ``Float8Linear.__init__`` derives it.
  A layer with ``enable_fsdp_float8_all_gather`` cannot be switched (FSDP casts its weight before the layer runs).
* torchao QAT (``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding``): None switches the fake quantizers off
  (``enabled = False``, as torchao's ``disable_*_fake_quant``); ``"int8"`` (weights per channel, activations per
  token, asymmetric), ``"int4"`` (weights in groups of 32, activations per token), ``"fp8"`` / ``"fp8_e4m3"`` /
  ``"fp8:tensorwise"`` (E4M3, one scale per tensor), ``"fp8:rowwise"`` (E4M3 per row), ``"fp8_e5m2"`` give the
  weight and, where the layer fake-quantizes them, the activations new fake quantizers of that config (tried on the
  weight first: a group size the weight refuses fails here).  Gradients stay in high precision (QAT has none).
* torchao prototype QAT (``MXFakeQuantizedLinear`` / ``NVFP4FakeQuantizedLinear``): None runs ``F.linear`` on the
  layer's parameters (what torchao's ``to_linear()`` computes, in place); ``"mxfp8"`` / ``"mxfp4"`` (an MX layer:
  both configs' element type, their block size, scaling mode and kernel preference kept) and ``"nvfp4"`` (an
  NVFP4 layer) switch it on again.
* torchao MXFP8 training (``nn.Linear`` whose parameters are ``MXFP8TrainingWeightWrapperTensor``) and float8
  training by wrapper (``Float8TrainingWeightWrapperTensor``): None runs ``F.linear`` on the wrapped data (through
  torchao's ``unwrap_weight``, so gradients still reach the wrapper parameters); an ``"fp8..."`` recipe turns each
  wrapper parameter into a ``Float8TrainingWeightWrapperTensor`` of ``Float8TrainingOpConfig(float8_linear_recipe=
  ...)``, what ``quantize_(m, Float8TrainingOpConfig(...))`` makes but the same parameter objects (torchao's two
  wrapper classes share their layout: ``_data`` and ``config``), emulated off a CUDA device of compute capability
  8.9+; ``"mxfp8"`` switches an MXFP8 layer on again.
* torchao INT8 mixed-precision training (an ``nn.Linear`` whose weight is ``Int8MixedPrecisionTrainingLinearWeight``,
  or ``Int8MixedPrecisionTrainingLinear``): None gives the layer a config of its own with ``output``, ``grad_input``
  and ``grad_weight`` off (torchao's own high-precision GEMMs; the config ``quantize_`` shared between layers is
  left alone), ``"int8"`` one with all three on.  A weight-wrapper layer that this torchao never runs in INT8
  (:mod:`quantwatch.agent.adapters.torchao_int8`) refuses ``"int8"``.
* torchao ``NVFP4Linear``: None runs ``F.linear``; an ``"fp8..."`` recipe makes it a ``Float8Linear`` in place (its
  class, and the attributes ``Float8Linear.__init__`` sets; emulated as above), not under tensor parallelism nor
  when a wrapper such as FSDP2 derived its class; ``"nvfp4"`` switches it on again.

NVFP4 layers, and MX layers whose kernel preference is not ``EMULATED``, need a CUDA GPU to run quantized; switched
off or to an emulated FP8 recipe they run anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters.linear import (
    plain_linear_forward,
    runs_plain_linear,
    training_weight_classes,
)
from quantwatch.agent.adapters.registry import loaded_classes
from quantwatch.agent.adapters.torchao_float8 import Float8LinearAdapter, Float8TrainingWeightAdapter
from quantwatch.agent.adapters.torchao_int8 import (
    INT8_TRAINING_FORMAT,
    Int8MixedPrecisionTrainingAdapter,
    computes_int8,
    set_int8_gemms,
)
from quantwatch.agent.adapters.torchao_mx import MXFP8TrainingAdapter, NVFP4TrainingAdapter, PrototypeQatAdapter
from quantwatch.agent.adapters.torchao_qat import TorchAoQatAdapter
from quantwatch.agent.errors import ConfigError
from quantwatch.kernels import QuantSpec
from quantwatch.kernels.quantizer import Quantizer

__all__ = ["FLOAT8_RECIPES", "FP8", "check_format", "switch_precision", "switchable"]

FP8 = "fp8"
"""The format name that means FP8 as training recipes use it: E4M3 for weights and inputs, E5M2 for gradients."""

#: The float8 format names and the torchao ``Float8LinearRecipeName`` each means.
FLOAT8_RECIPES = {
    FP8: "tensorwise",
    "fp8:tensorwise": "tensorwise",
    "fp8:rowwise": "rowwise",
    "fp8:rowwise_with_gw_hp": "rowwise_with_gw_hp",
}
_RECIPE_NAMES = ", ".join(repr(name) for name in FLOAT8_RECIPES)

_QUANTIZERS = ("weight", "input", "grad")


def check_format(fmt: str | None) -> None:
    """Raise ConfigError naming ``format`` unless ``fmt`` is None, an ``"fp8"`` recipe name or a format/preset name."""
    if fmt is not None and not isinstance(fmt, str):
        raise ConfigError("format", f"must be None or a format name, got {type(fmt).__name__}")
    if fmt is None or fmt.strip().lower() in FLOAT8_RECIPES:
        return
    try:
        QuantSpec(fmt)
    except (ValueError, TypeError) as exc:
        raise ConfigError("format", f"{fmt!r} is not one of {_RECIPE_NAMES} nor a QuantWatch format: {exc}") from None


def _refused(module: nn.Module, fmt: str, takes: str) -> ConfigError:
    return ConfigError("format", f"a {type(module).__name__} cannot be switched to {fmt!r} in place; it takes {takes}")


def _weight(module: nn.Module) -> Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise ConfigError("layers", f"a {type(module).__name__} without a weight tensor cannot be switched")
    return weight


def _restore_forward(module: nn.Module) -> None:
    """Undo `plain_linear_forward`: the layer's class's own forward runs again."""
    if runs_plain_linear(module):
        del module.forward


def _switch_quantwatch(module: nn.Module, fmt: str | None) -> None:
    if fmt is None:
        specs: dict[str, QuantSpec | None] = dict.fromkeys(_QUANTIZERS)
    elif FLOAT8_RECIPES.get(fmt) == "tensorwise":
        specs = {"weight": QuantSpec("fp8_e4m3"), "input": QuantSpec("fp8_e4m3"), "grad": QuantSpec("fp8_e5m2")}
    elif fmt in FLOAT8_RECIPES:
        raise _refused(module, fmt, f"None, {FP8!r} or a QuantWatch format or preset")
    else:
        specs = dict.fromkeys(_QUANTIZERS, QuantSpec(fmt))
    weight = getattr(module, "weight", None)
    for kind, spec in specs.items():
        old = getattr(module, f"{kind}_quantizer")
        quantizer = Quantizer(spec, getattr(old, "generator", None))
        setattr(module, f"{kind}_quantizer", quantizer.to(weight.device) if weight is not None else quantizer)


def _emulate(device: torch.device) -> bool:
    """Whether float8 GEMMs must be emulated on ``device`` (``torch._scaled_mm`` needs CUDA compute capability 8.9)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def _recipe(fmt: str, **kept: Any) -> Any:
    from torchao.float8.config import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(FLOAT8_RECIPES[fmt]), **kept)


def _mm_config(config: Any) -> Any:
    """The ``LinearMMConfig`` ``Float8Linear.__init__`` derives from ``config``."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    emulate, pad = config.emulate, config.pad_inner_dim
    return LinearMMConfig(*(ScaledMMConfig(emulate, gemm.use_fast_accum, False, pad) for gemm in gemms))


def _set_float8_config(module: nn.Module, config: Any) -> None:
    """What ``Float8Linear.__init__`` sets from its config."""
    module.config = config
    module.linear_mm_config = _mm_config(config)
    for tensor in ("input", "weight", "grad_output"):
        setattr(module, f"scaling_type_{tensor}", getattr(config, f"cast_config_{tensor}").scaling_type)


def _switch_float8(module: nn.Module, fmt: str | None) -> None:
    from torchao.float8.config import CastConfig, ScalingType

    config: Any = getattr(module, "config")  # noqa: B009 (torchao's attribute, untyped)
    if config.enable_fsdp_float8_all_gather:
        raise ConfigError("format", "a Float8Linear with enable_fsdp_float8_all_gather cannot be switched: FSDP casts "
                          "its weight to float8 before the layer runs")  # fmt: skip
    if fmt is None:
        off = CastConfig(scaling_type=ScalingType.DISABLED)
        casts = {f.name: off for f in dataclasses.fields(config) if f.name.startswith("cast_config")}
        _set_float8_config(module, dataclasses.replace(config, **casts))
    elif fmt in FLOAT8_RECIPES:
        _set_float8_config(module, _recipe(fmt, emulate=config.emulate, pad_inner_dim=config.pad_inner_dim))
    else:
        raise _refused(module, fmt, f"None or a float8 recipe ({_RECIPE_NAMES})")


def _qat_configs(module: nn.Module, fmt: str) -> tuple[Any, Any]:
    """(weight config, activation config) of torchao QAT for ``fmt``."""
    from torchao.quantization.granularity import PerRow, PerTensor
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig

    if fmt in ("int8", "int4"):
        dtype = torch.int8 if fmt == "int8" else getattr(torch, "int4")  # noqa: B009 (absent from torch's stubs)
        per_token = IntxFakeQuantizeConfig(dtype, "per_token", is_symmetric=False)
        if fmt == "int8":
            return IntxFakeQuantizeConfig(dtype, "per_channel"), per_token
        return IntxFakeQuantizeConfig(dtype, group_size=32), per_token
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    floats = {FP8: (e4m3, PerTensor()), "fp8:tensorwise": (e4m3, PerTensor()), "fp8:rowwise": (e4m3, PerRow()),
              "fp8_e4m3": (e4m3, PerTensor()), "fp8_e5m2": (e5m2, PerTensor())}  # fmt: skip
    if fmt not in floats:
        raise _refused(module, fmt, f"None, 'int8', 'int4', {', '.join(map(repr, floats))}")
    config = Float8FakeQuantizeConfig(*floats[fmt])
    return config, config


def _switch_qat(module: nn.Module, fmt: str | None) -> None:
    activation = getattr(module, "activation_fake_quantizer", None)
    if fmt is None:
        for quantizer in (getattr(module, "weight_fake_quantizer"), activation):  # noqa: B009
            if quantizer is not None:
                quantizer.enabled = False
        return
    from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase

    weight_config, activation_config = _qat_configs(module, fmt)
    weight = FakeQuantizerBase.from_config(weight_config)
    with torch.no_grad():
        weight(_weight(module).detach())  # a config the weight's shape refuses raises here, the layer unchanged
    module.weight_fake_quantizer = weight
    if activation is not None:
        module.activation_fake_quantizer = FakeQuantizerBase.from_config(activation_config)


def _switch_prototype_qat(module: nn.Module, fmt: str | None) -> None:
    if fmt is None:
        plain_linear_forward(module)
        return
    is_mx = isinstance(module, loaded_classes("torchao.prototype.qat.mx:MXFakeQuantizedLinear"))
    elements = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}
    if is_mx and fmt in elements:
        for attr in ("weight_config", "activation_config"):
            setattr(module, attr, dataclasses.replace(getattr(module, attr), dtype=elements[fmt]))
    elif is_mx or fmt != "nvfp4":
        raise _refused(module, fmt, "None or its own kind of format (an MX layer 'mxfp8' / 'mxfp4', NVFP4 'nvfp4')")
    _restore_forward(module)


def _float8_op_config(fmt: str, device: torch.device) -> Any:
    """torchao's ``Float8TrainingOpConfig`` of the recipe ``fmt``, its GEMMs emulated where ``device`` needs it."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    config = Float8TrainingOpConfig(float8_linear_recipe=FLOAT8_RECIPES[fmt])
    if _emulate(device):  # the configs __post_init__ derives from the recipe, emulated
        config._float8_linear_config = dataclasses.replace(config._float8_linear_config, emulate=True)
        config._linear_mm_config = _mm_config(config._float8_linear_config)
    return config


def _switch_training_weight(module: nn.Module, fmt: str | None) -> None:
    if fmt is None:
        plain_linear_forward(module)
        return
    wrappers = [p for p in module.parameters(recurse=False) if isinstance(p, training_weight_classes())]
    float8, mxfp8 = (training_weight_classes(f"{kind}TrainingWeightWrapperTensor") for kind in ("Float8", "MXFP8"))
    if fmt in FLOAT8_RECIPES and float8:
        config = _float8_op_config(fmt, _weight(module).device)
        for parameter in wrappers:
            parameter.__class__ = float8[0]  # the two wrapper classes share their layout: `_data` and `config`
            setattr(parameter, "config", config)  # noqa: B010 (the wrapper's attribute)
    elif fmt != "mxfp8" or not mxfp8 or not all(isinstance(p, mxfp8) for p in wrappers):
        raise _refused(module, fmt, f"None, a float8 recipe ({_RECIPE_NAMES}) or, an MXFP8 layer, 'mxfp8'")
    _restore_forward(module)


def _switch_nvfp4(module: nn.Module, fmt: str | None) -> None:
    if fmt is None:
        plain_linear_forward(module)
        return
    if fmt in FLOAT8_RECIPES:
        nvfp4 = loaded_classes("torchao.prototype.moe_training.nvfp4_training.nvfp4_training:NVFP4Linear")
        if type(module) not in nvfp4 or getattr(module, "process_group", None) is not None:
            raise ConfigError("format", f"a {type(module).__name__} becomes a Float8Linear in place only as a "
                              "plain NVFP4Linear: not tensor-parallel, nor a class FSDP2 derived")  # fmt: skip
        from torchao.float8.float8_linear import Float8Linear

        _restore_forward(module)
        module.__class__ = Float8Linear
        _set_float8_config(module, _recipe(fmt, emulate=_emulate(_weight(module).device)))
    elif fmt == "nvfp4":
        _restore_forward(module)
    else:
        raise _refused(module, fmt, f"None, 'nvfp4' or a float8 recipe ({_RECIPE_NAMES})")


def _switch_int8_training(module: nn.Module, fmt: str | None) -> None:
    if fmt is not None and fmt != INT8_TRAINING_FORMAT:
        raise _refused(module, fmt, f"None or {INT8_TRAINING_FORMAT!r}")
    if fmt is not None and not computes_int8(module):
        raise ConfigError(
            "format",
            f"this torchao runs a {type(_weight(module)).__name__} weight in high precision whatever its config "
            "(F.linear is not routed to its INT8 GEMMs); module_swap=True works",
        )
    set_int8_gemms(module, on=fmt is not None)


def _is_quantwatch(module: nn.Module) -> bool:
    return all(hasattr(module, f"{kind}_quantizer") for kind in _QUANTIZERS)


#: Per layer kind, how it is recognised (as the built-in adapter measuring it does) and switched.
_SWITCHES: tuple[tuple[Callable[[nn.Module], bool], Callable[[nn.Module, str | None], None]], ...] = (
    (_is_quantwatch, _switch_quantwatch),
    (Float8LinearAdapter().recognises, _switch_float8),
    (TorchAoQatAdapter().recognises, _switch_qat),
    (PrototypeQatAdapter().recognises, _switch_prototype_qat),
    (MXFP8TrainingAdapter().recognises, _switch_training_weight),
    (Float8TrainingWeightAdapter().recognises, _switch_training_weight),
    (NVFP4TrainingAdapter().recognises, _switch_nvfp4),
    (Int8MixedPrecisionTrainingAdapter().recognises, _switch_int8_training),
)


def switchable(module: nn.Module) -> bool:
    """Whether ``module`` is of a kind `switch_precision` switches."""
    return any(recognises(module) for recognises, _ in _SWITCHES)


def switch_precision(module: nn.Module, fmt: str | None) -> None:
    """Switch ``module``'s quantization to ``fmt`` (None: off) in place (see the module doc); ConfigError (field
    ``layers``) for a module of a kind this cannot switch, (field ``format``) for a format it cannot take."""
    key = fmt.strip().lower() if isinstance(fmt, str) else None
    for recognises, switch in _SWITCHES:
        if recognises(module):
            switch(module, key)
            return
    raise ConfigError("layers", f"cannot switch the precision of a {type(module).__name__}")
