"""Which adapter measures which module, found once at ``attach()``.

Like torchao's ``quantize_`` (one walker, a handler registered per config type), :func:`find_layers` walks the model
once and hands each module to the first registered :class:`~quantwatch.agent.adapters.registry.Adapter` that
recognises it (by class, or by a parameter's type where the module stays ``nn.Linear``).  Adapters registered by users
with :func:`register_adapter` are asked before the built-in ones, the most recent first, so a user can take over any
kind of module.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from quantwatch.agent.adapters.builtin import BUILTIN_ADAPTERS
from quantwatch.agent.adapters.registry import FORMAT_KINDS, Adapter, AdapterContext, Found, LayerInfo
from quantwatch.agent.errors import ConfigError
from quantwatch.agent.layers import LayerAdapter
from quantwatch.agent.wrappers import named_modules

__all__ = [
    "AdapterHandle",
    "adapter_for",
    "build_layer_adapters",
    "dequantize_shadow",
    "find_layers",
    "register_adapter",
    "registered_adapters",
]

logger = logging.getLogger("quantwatch.agent")


class AdapterHandle:
    """Returned by :func:`register_adapter`; :meth:`remove` takes the adapter out of the registry again."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def remove(self) -> None:
        """Unregister the adapter (no effect when already removed)."""
        with _LOCK:
            if self.adapter in _USER_ADAPTERS:
                _USER_ADAPTERS.remove(self.adapter)


_LOCK = threading.Lock()
_USER_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter) -> AdapterHandle:
    """Register ``adapter`` for the next ``attach()`` calls, asked before the built-in adapters (and before adapters
    registered earlier).  Raises ``TypeError`` for anything but an :class:`Adapter` instance."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an instance of quantwatch.agent.Adapter, got {type(adapter).__name__}")
    with _LOCK:
        _USER_ADAPTERS.insert(0, adapter)
    return AdapterHandle(adapter)


def registered_adapters() -> list[Adapter]:
    """Every adapter in the order they are asked: user adapters (newest first), then the built-in ones."""
    with _LOCK:
        return [*_USER_ADAPTERS, *BUILTIN_ADAPTERS]


def _recognising(module: nn.Module, adapters: Sequence[Adapter], broken: set[int]) -> Adapter | None:
    for adapter in adapters:
        if id(adapter) in broken:
            continue
        try:
            if adapter.recognises(module):
                return adapter
        except Exception as exc:  # a broken user adapter must not break attach for every other layer
            broken.add(id(adapter))
            logger.warning("quantwatch agent: adapter %r failed to inspect a module; skipped: %s", adapter.name, exc)
    return None


def _formats(adapter: Adapter, name: str, module: nn.Module) -> dict[str, str]:
    try:
        found = adapter.formats(module)
    except Exception as exc:
        logger.warning("quantwatch agent: %s: adapter %r cannot tell its formats: %s", name, adapter.name, exc)
        found = {}
    return {kind: str(found.get(kind, "unknown")) for kind in FORMAT_KINDS}


def adapter_for(module: nn.Module) -> Adapter | None:
    """The adapter recognising ``module`` now (None: none does), for a layer whose quantization changed during
    training."""
    return _recognising(module, registered_adapters(), set())


def layer_formats(name: str, module: nn.Module) -> dict[str, str] | None:
    """The format per tensor kind of ``module`` as the adapter recognising it tells now (None: none recognises it),
    for a layer whose quantization changed during training."""
    adapter = adapter_for(module)
    return None if adapter is None else _formats(adapter, name, module)


def layer_patterns(layers: str | Iterable[str]) -> tuple[str, ...]:
    """``layers`` (a glob pattern or a list of them) as a tuple; ConfigError naming ``layers`` unless non-empty."""
    patterns = (layers,) if isinstance(layers, str) else tuple(layers)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError("layers", f"must be a glob pattern or a list of them, got {layers!r}")
    return patterns


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether the qualified layer name ``name`` matches one of the glob ``patterns``."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def find_layers(
    model: nn.Module, layers: str | Sequence[str] | None, adapters: Sequence[Adapter] | None = None
) -> dict[str, Found]:
    """The model's modules that some adapter recognises, by qualified name, narrowed by ``layers`` (glob patterns).

    Raises :class:`ConfigError` for malformed patterns and for patterns that match no recognised module; warns when
    the model has no recognised module at all."""
    adapters = registered_adapters() if adapters is None else list(adapters)
    candidates: dict[str, tuple[nn.Module, Adapter]] = {}
    broken: set[int] = set()
    # Named as in the bare model: without the `module.` of DDP, the `_orig_mod.` of torch.compile, etc.
    for name, module in named_modules(model):
        if not name:
            continue
        adapter = _recognising(module, adapters, broken)
        if adapter is not None:
            candidates[name] = (module, adapter)
    if layers is not None:
        patterns = layer_patterns(layers)
        chosen = {n: c for n, c in candidates.items() if matches(n, patterns)}
        if not chosen:
            known = ", ".join(list(candidates)[:20]) or "none"
            raise ConfigError("layers", f"no quantized layer matches {patterns}; quantized layers: {known}")
        candidates = chosen
    if not candidates:
        logger.warning(
            "quantwatch agent: no quantized layer found in the model (a plain nn.Linear quantizes nothing: convert the "
            "model first, with quantwatch.kernels.quantize_model or a torchao stack); only watched kernels will be "
            "measured"
        )
    return {
        name: Found(module, adapter, _formats(adapter, name, module)) for name, (module, adapter) in candidates.items()
    }


def build_layer_adapters(
    found: Mapping[str, Found], context: AdapterContext
) -> tuple[list[LayerAdapter], list[LayerInfo]]:
    """The per-layer measurers of ``found`` and their descriptions, in model order.

    A layer whose adapter cannot measure it is reported once in a log warning, by name, and left out."""
    measurers: list[LayerAdapter] = []
    infos: list[LayerInfo] = []
    for name, entry in found.items():
        try:
            measurer = entry.adapter.create(name, entry.module, context)
        except Exception as exc:
            logger.warning(
                "quantwatch agent: %s (%s) is recognised by adapter %r but cannot be measured: %s; left out",
                name,
                type(entry.module).__name__,
                entry.adapter.name,
                exc,
            )
            continue
        measurers.append(measurer)
        infos.append(LayerInfo(name, entry.adapter.name, entry.formats))
    return measurers, infos


def dequantize_shadow(shadow: nn.Module, found: Mapping[str, Found]) -> None:
    """Let each found layer's adapter de-quantize its copy in the shadow model ``shadow``; one that cannot is named
    in a log warning and stays quantized there."""
    modules = dict(shadow.named_modules())
    for name, entry in found.items():
        try:
            entry.adapter.dequantize(modules[name])
        except Exception as exc:
            logger.warning("quantwatch agent: %s stays quantized in the shadow model: %s", name, exc)
