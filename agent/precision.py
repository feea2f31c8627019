"""Switching one layer's quantization off, or to another format, in place: what ``qw.actions.keep_high_precision``
does to each kind of layer the agent knows.

* QuantWatch's own layers (``QuantLinear`` and what ``quantize_model`` made from a ``Recipe``): each tensor's
  ``Quantizer`` is replaced by one of the new format (``None``: unquantized); the parameters stay the same objects, so
  the optimizer and DDP's buckets keep working.
* torchao ``Float8Linear``: every cast of its ``config`` is switched to ``ScalingType.DISABLED``, so its three GEMMs
  run in the input's precision (torchao's own high-precision path); other formats are not offered for it.
* torchao QAT (``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding``): the fake quantizers are switched off
  (``enabled = False``, as torchao's own ``disable_*_fake_quant`` do).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from quantwatch.agent.errors import ConfigError
from quantwatch.kernels import QuantSpec
from quantwatch.kernels.quantizer import Quantizer

__all__ = ["FP8", "switch_precision"]

FP8 = "fp8"
"""The format name that means FP8 as training recipes use it: E4M3 for weights and inputs, E5M2 for gradients."""

_QUANTIZERS = ("weight", "input", "grad")


def _specs(fmt: str | None) -> dict[str, QuantSpec | None]:
    """The spec of each tensor kind for ``fmt`` (None: unquantized); ConfigError names ``format`` when invalid."""
    if fmt is None:
        return dict.fromkeys(_QUANTIZERS)
    if fmt == FP8:
        return {"weight": QuantSpec("fp8_e4m3"), "input": QuantSpec("fp8_e4m3"), "grad": QuantSpec("fp8_e5m2")}
    try:
        spec = QuantSpec(fmt)
    except (ValueError, TypeError) as exc:
        raise ConfigError("format", f"{fmt!r} is not a format QuantSpec accepts: {exc}") from None
    return dict.fromkeys(_QUANTIZERS, spec)


def check_format(fmt: str | None) -> None:
    """Raise ConfigError naming ``format`` unless ``fmt`` is None, ``"fp8"`` or a format/preset name."""
    if fmt is not None and not isinstance(fmt, str):
        raise ConfigError("format", f"must be None or a format name, got {type(fmt).__name__}")
    _specs(fmt)


def _switch_quantwatch(module: nn.Module, fmt: str | None) -> None:
    weight = getattr(module, "weight", None)
    for kind, spec in _specs(fmt).items():
        old = getattr(module, f"{kind}_quantizer")
        quantizer = Quantizer(spec, getattr(old, "generator", None))
        setattr(module, f"{kind}_quantizer", quantizer.to(weight.device) if weight is not None else quantizer)


def _switch_float8(module: nn.Module, fmt: str | None) -> None:
    from torchao.float8.config import CastConfig, ScalingType

    if fmt is not None:
        raise ConfigError("format", "a torchao Float8Linear can only be kept in high precision (format=None)")
    config: Any = getattr(module, "config")  # noqa: B009 (torchao's attribute, untyped)
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    casts = {f.name: off for f in dataclasses.fields(config) if f.name.startswith("cast_config")}
    module.config = dataclasses.replace(config, **casts)
    for tensor in ("input", "weight", "grad_output"):
        setattr(module, f"scaling_type_{tensor}", ScalingType.DISABLED)


def _switch_qat(module: nn.Module, fmt: str | None) -> None:
    if fmt is not None:
        raise ConfigError("format", "torchao QAT layers can only be kept in high precision (format=None)")
    for attr in ("weight_fake_quantizer", "activation_fake_quantizer"):
        quantizer = getattr(module, attr, None)
        if quantizer is not None:
            quantizer.enabled = False


def switch_precision(module: nn.Module, fmt: str | None) -> None:
    """Switch ``module``'s quantization to ``fmt`` (None: off) in place; ConfigError (field ``layers``) for a module
    of a kind this cannot switch, (field ``format``) for a format it cannot take."""
    if all(hasattr(module, f"{kind}_quantizer") for kind in _QUANTIZERS):
        _switch_quantwatch(module, fmt)
    elif type(module).__name__ == "Float8Linear" and hasattr(module, "config"):
        _switch_float8(module, fmt)
    elif hasattr(module, "weight_fake_quantizer"):
        _switch_qat(module, fmt)
    else:
        raise ConfigError("layers", f"cannot switch the precision of a {type(module).__name__}")
