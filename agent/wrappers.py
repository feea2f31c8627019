"""What the agent needs to know about the wrappers that training frameworks put around a model.

* **Names.** ``DistributedDataParallel``/``DataParallel`` hold the model as ``.module``, ``torch.compile`` as
  ``._orig_mod`` (an ``OptimizedModule``), FSDP1 as ``._fsdp_wrapped_module`` and activation checkpointing's
  ``checkpoint_wrapper`` as ``._checkpoint_wrapped_module``: :func:`named_modules` walks the model like
  ``nn.Module.named_modules`` but leaves those segments out, so a layer has the name it has in the bare model
  (``blocks.3.attn.qkv``, never ``module._orig_mod.blocks.3.attn.qkv``) whichever wrappers a run uses.  FSDP2
  (``fully_shard``) swaps the class in place and adds no segment.
* **Compiled regions.** Dynamo traces a compiled module's forward together with the hooks of the modules inside it
  and guards on them, so installing the agent's hooks on a sampled step (and removing them after) would make it
  recompile, and the hooks' own work would break the graph.  :class:`CompiledRegions` instead runs the compiled
  modules' original, eager modules while a step is sampled, and gives their compiled forward back afterwards: the
  compiled graphs and their guards never see an agent hook, so the agent causes no recompilation and no graph break;
  a sampled step runs at eager speed.  It covers ``torch.compile(module)`` (an ``OptimizedModule`` anywhere in the
  model) and ``module.compile()`` (the module's ``_compiled_call_impl``).
* **FSDP2.** A module that ``fully_shard`` manages holds its unsharded weights only between FSDP's pre-forward and
  post-forward hooks (:func:`shards_after_forward` says so); the layer adapters compare inside that window, so the
  reference uses the full weights the forward used, and every figure is whole on every rank (no collective needed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["CompiledRegions", "named_modules", "shards_after_forward", "unwrap"]


def _wrapped_child(module: nn.Module) -> str | None:
    """The attribute under which ``module``, a wrapper, holds the module it wraps; None for any other module."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, DistributedDataParallel | DataParallel):
        return "module"
    if _is_optimized_module(module):
        return "_orig_mod"
    for attribute in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
        if isinstance(getattr(module, attribute, None), nn.Module):
            return attribute
    return None


def _is_optimized_module(module: nn.Module) -> bool:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without Dynamo
        return False
    return isinstance(module, OptimizedModule)


def shards_after_forward(module: nn.Module) -> bool:
    """True when FSDP2 (``fully_shard``) manages ``module`` itself: its forward hook frees the unsharded weights."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside every wrapper at the top of ``model`` (``model`` itself when it is not wrapped)."""
    while (attribute := _wrapped_child(model)) is not None:
        model = getattr(model, attribute)
    return model


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for every module of ``model`` but the wrappers, named as in the unwrapped model.

    Like ``nn.Module.named_modules``: each module once (at its first name), the root as ``""``."""
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        attribute = _wrapped_child(module)
        if attribute is not None:
            yield from walk(getattr(module, attribute), prefix)
            return
        if id(module) in seen:
            return
        seen.add(id(module))
        yield prefix, module
        for name, child in module.named_children():
            yield from walk(child, f"{prefix}.{name}" if prefix else name)

    yield from walk(model, "")


class CompiledRegions:
    """The compiled modules of a model, switchable to their eager originals while a step is sampled."""

    def __init__(self, model: nn.Module) -> None:
        self._optimized: list[nn.Module] = []
        self._compiled_in_place: list[nn.Module] = []
        for module in model.modules():
            if _is_optimized_module(module):
                self._optimized.append(module)
            elif getattr(module, "_compiled_call_impl", None) is not None:
                self._compiled_in_place.append(module)
        self._saved: list[tuple[nn.Module, str, Any]] = []

    def __bool__(self) -> bool:
        return bool(self._optimized or self._compiled_in_place)

    @property
    def eager(self) -> bool:
        """True while the compiled modules run eagerly."""
        return bool(self._saved)

    def run_eager(self) -> None:
        """Make every compiled module call its original module, hooks and all, without Dynamo (idempotent)."""
        if self._saved:
            return
        for module in self._optimized:
            # OptimizedModule.forward is its Dynamo-wrapped call of the original module (an instance attribute).
            self._saved.append((module, "forward", module.__dict__["forward"]))
            original: nn.Module = module.__dict__["_modules"]["_orig_mod"]
            module.__dict__["forward"] = original.__call__
        for module in self._compiled_in_place:
            self._saved.append((module, "_compiled_call_impl", module.__dict__["_compiled_call_impl"]))
            module.__dict__["_compiled_call_impl"] = None

    def run_compiled(self) -> None:
        """Give every compiled module its compiled forward back (idempotent)."""
        for module, attribute, value in reversed(self._saved):
            module.__dict__[attribute] = value
        self._saved.clear()
