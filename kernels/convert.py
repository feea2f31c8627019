"""Swap ``nn.Linear`` (and transformers' ``Conv1D``) modules for `QuantLinear` (`QuantConv1D`) by glob rules on their
qualified names."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from .conv1d import QuantConv1D, is_conv1d
from .layers import DEFAULT_GRAD, DEFAULT_INPUT, DEFAULT_WEIGHT, QuantLinear
from .quantizer import QuantSpec


@dataclass(frozen=True)
class QuantConfig:
    """The three specs of one quantized linear layer; ``None`` keeps that tensor in full precision."""

    weight: QuantSpec | None = DEFAULT_WEIGHT
    input: QuantSpec | None = DEFAULT_INPUT
    grad: QuantSpec | None = DEFAULT_GRAD

    def __post_init__(self) -> None:
        for name in ("weight", "input", "grad"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, QuantSpec):
                raise TypeError(f"QuantConfig.{name} must be a QuantSpec or None, got {type(value).__name__}")


@dataclass(frozen=True)
class Recipe:
    """Rules ``(glob on the qualified module name, QuantConfig or None)``; the first match wins.

    A rule mapping to ``None`` keeps matching layers as plain ``nn.Linear``; layers no rule matches get ``default``
    (``None``: left alone). Example: keep the first and last layers in FP8, the rest in NVFP4::

        Recipe(rules=[("embed*", QuantConfig()), ("head", QuantConfig()),
                      ("*", QuantConfig(weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4")))])
    """

    rules: Sequence[tuple[str, QuantConfig | None]] = field(default_factory=tuple)
    default: QuantConfig | None = None

    def __post_init__(self) -> None:
        rules = tuple(self.rules)
        for index, rule in enumerate(rules):
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
                raise TypeError(f"Recipe.rules[{index}] must be a (glob, QuantConfig | None) pair, got {rule!r}")
            if rule[1] is not None and not isinstance(rule[1], QuantConfig):
                raise TypeError(f"Recipe.rules[{index}][1] must be a QuantConfig or None, got {type(rule[1]).__name__}")
        if self.default is not None and not isinstance(self.default, QuantConfig):
            raise TypeError(f"Recipe.default must be a QuantConfig or None, got {type(self.default).__name__}")
        object.__setattr__(self, "rules", rules)

    def config_for(self, name: str) -> QuantConfig | None:
        """The config of the first rule whose glob matches ``name`` (case-sensitive), else ``default``."""
        for pattern, config in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return config
        return self.default


def quantize_model(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Replace every ``nn.Linear`` (not already a `QuantLinear`) and every transformers ``Conv1D`` (GPT-2 family;
    recognised by class path, transformers is not imported) whose recipe config is not None, in place.

    The new layers take over the old Parameter objects, so optimizers built before still update them (a ``Conv1D``
    becomes a `QuantConv1D`, which keeps its ``(in, out)`` weight). Returns the model (or the replacement when
    ``model`` itself is a matching layer, whose qualified name is ``""``). Raises ValueError naming the layer for an
    ``nn.LazyLinear`` that has not run its first forward yet (its shape is unknown): convert after one forward.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) and not isinstance(module, QuantLinear)) or is_conv1d(module)
    ]
    for name, module in targets:
        config = recipe.config_for(name)
        if config is None:
            continue
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():  # type: ignore[misc]
            raise ValueError(
                f"layer {name or '<model>'!r} is an uninitialised {type(module).__name__}: run one forward before "
                "quantize_model so its shape is known"
            )
        replacement: QuantLinear
        if isinstance(module, nn.Linear):
            replacement = QuantLinear.from_linear(module, weight=config.weight, input=config.input, grad=config.grad)
        else:
            replacement = QuantConv1D.from_conv1d(module, weight=config.weight, input=config.input, grad=config.grad)
        if name == "":
            return replacement
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement)
    return model
