"""What an adapter is: the interface each kind of quantized layer implements, the context it measures in, and what
discovery found for a layer (:mod:`quantwatch.agent.adapters.discovery` walks the model and asks the adapters).

An adapter that recognises a module but cannot measure it (an unsupported configuration, an attribute a newer
release renamed) raises :class:`UnsupportedLayerError` (or anything else) from :meth:`Adapter.create`: the layer is
reported once by name in a log warning and left out; nothing raises into training.
"""

from __future__ import annotations

import abc
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quantwatch.agent.failures import FailureLog
from quantwatch.agent.layers import DeferredStatistics, LayerAdapter, OverheadClock
from quantwatch.protocol import HIGH_PRECISION, TENSOR_KINDS

__all__ = [
    "FORMAT_KINDS",
    "HIGH_PRECISION",
    "Adapter",
    "AdapterContext",
    "Found",
    "LayerInfo",
    "UnsupportedLayerError",
    "loaded_classes",
]

logger = logging.getLogger("quantwatch.agent")

#: The tensor kinds a layer's format is given for (the protocol's).
FORMAT_KINDS: tuple[str, ...] = TENSOR_KINDS


def loaded_classes(*names: str) -> tuple[type, ...]:
    """The classes named ``"module:Class"`` whose module is already imported (and has them: another torchao version
    may not): a layer of such a class exists only once its module is loaded, so recognising one never imports
    torchao."""
    classes: list[type] = []
    for name in names:
        module_name, _, class_name = name.partition(":")
        found = getattr(sys.modules.get(module_name), class_name, None)
        if found is not None:
            classes.append(found)
    return tuple(classes)


class UnsupportedLayerError(Exception):
    """Raised by :meth:`Adapter.create` for a module the adapter recognises but cannot measure."""


@dataclass(frozen=True)
class AdapterContext:
    """What a per-layer measurer shares with the monitor: its failure log, overhead clock, deferred statistics and
    the dtype of the reference computation (``"float32"`` default, or ``"bfloat16"``)."""

    failures: FailureLog
    clock: OverheadClock
    deferred: DeferredStatistics
    reference_dtype: str = "float32"


class Adapter(abc.ABC):
    """One kind of quantized module the agent can measure.

    Subclasses set :attr:`name` and implement :meth:`recognises` (cheap: it is asked of every module at attach),
    :meth:`formats` and :meth:`create`, which returns the per-layer measurer (a
    :class:`~quantwatch.agent.layers.LayerAdapter`; subclass
    :class:`~quantwatch.agent.adapters.ShadowedLayer` to get ``output_*`` and ``update_cosine`` from a reference
    forward)."""

    name: str = "adapter"

    @abc.abstractmethod
    def recognises(self, module: nn.Module) -> bool:
        """True when this adapter handles ``module``."""

    def formats(self, module: nn.Module) -> dict[str, str]:
        """The module's format and scaling per tensor kind (``weight``, ``input``, ``grad``), e.g.
        ``"fp8_e4m3:tensor"``, ``"nvfp4"``, ``"int4:group32"``, ``"high_precision"``; ``"unknown"`` by default."""
        return dict.fromkeys(FORMAT_KINDS, "unknown")

    def dequantize(self, module: nn.Module) -> None:
        """Make ``module``, a layer of the FP32 shadow model's copy (``shadow="model"``), compute without
        quantization, keeping its parameters.  Default: nothing (the shadow model de-quantizes reference-forward and
        torch.ao QAT modules itself)."""
        del module  # nothing to switch off by default

    @abc.abstractmethod
    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """The measurer of ``module`` (named ``name``); raises :class:`UnsupportedLayerError` when it cannot measure
        it."""


class LayerInfo(str):
    """A monitored layer's qualified name (it compares and hashes as that string) with what was found for it:
    :attr:`adapter` (the adapter's name) and :attr:`formats` (format per tensor kind)."""

    adapter: str
    formats: Mapping[str, str]

    def __new__(cls, name: str, adapter: str, formats: Mapping[str, str]) -> LayerInfo:
        info = super().__new__(cls, name)
        info.adapter = adapter
        info.formats = dict(formats)
        return info

    @property
    def name(self) -> str:
        """The layer's qualified name, as a plain string."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"LayerInfo({self.name!r}, adapter={self.adapter!r}, formats={dict(self.formats)!r})"

    def __reduce__(self) -> Any:
        return (LayerInfo, (self.name, self.adapter, dict(self.formats)))


@dataclass(frozen=True)
class Found:
    """A module an adapter recognised."""

    module: nn.Module
    adapter: Adapter
    formats: dict[str, str] = field(default_factory=dict)
