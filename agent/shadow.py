"""The full FP32 shadow model (``shadow="model"``): a copy of the model without quantization, trained in lockstep.

Every monitored layer of the copy runs its FP32 reference instead of its quantized forward (``reference_forward`` for
protocol modules, fake quantizers switched off for QAT modules).  Each step the user's loss closure runs on the copy,
which is trained by its own optimizer, so ``loss_shadow`` and the per-layer ``weight_drift_rel_l2`` show how far
the quantized run has walked away from the full-precision baseline, and :meth:`ShadowModel.save` writes an FP32
checkpoint (same state-dict keys as the model) to roll back to.

The precision of every FP32-shadow computation (the layer references of ``output_*`` and ``update_cosine`` too) is
:func:`run_reference`'s: float32 by default, with autocast switched off for it, or ``reference_dtype="bfloat16"``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from quantwatch.agent.errors import ConfigError
from quantwatch.agent.rows import RowSampling, parse_shadow_rows

__all__ = ["REFERENCE_DTYPES", "ShadowModel", "ShadowOptions", "run_reference"]

#: ``attach(reference_dtype=...)``: the precision the layer references compute in.
REFERENCE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_reference(fn: Callable[..., Tensor], *inputs: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``fn(*inputs)`` in the shadow's precision: the one place that decides how a reference is computed.

    ``float32`` (the default, "the FP32 shadow"): autocast is switched off for the call and floating inputs are
    cast to float32, so a training step under ``torch.autocast(dtype=torch.bfloat16)`` is measured against a true
    FP32 reference (its figures then hold the BF16 matmul's rounding as well as the quantization).  ``bfloat16``
    (for users whose baseline is BF16 mixed precision): the call runs under ``torch.autocast`` to bfloat16 on the
    inputs' device, as an autocast BF16 baseline would compute it.  Weights are used as the module holds them."""
    device_type = inputs[0].device.type if inputs else "cpu"
    if dtype == torch.float32:
        cast = tuple(t.float() if t.is_floating_point() and t.dtype != torch.float32 else t for t in inputs)
        if not torch.is_autocast_enabled(device_type):
            return fn(*cast)  # entering an autocast context costs more than a small layer's comparison
        with torch.autocast(device_type, enabled=False):
            return fn(*cast)
    with torch.autocast(device_type, dtype=dtype):
        return fn(*inputs)


@dataclass(frozen=True)
class ShadowOptions:
    """How the layer references are computed: ``reference_dtype`` and ``shadow_rows`` of :func:`attach`."""

    reference_dtype: torch.dtype = torch.float32
    rows: RowSampling | None = None

    @classmethod
    def parse(cls, reference_dtype: Any, shadow_rows: Any) -> ShadowOptions:
        """Validated options; raises ConfigError naming the field."""
        if reference_dtype not in REFERENCE_DTYPES:
            known = ", ".join(repr(k) for k in REFERENCE_DTYPES)
            raise ConfigError("reference_dtype", f"must be one of {known}, got {reference_dtype!r}")
        return cls(REFERENCE_DTYPES[reference_dtype], parse_shadow_rows(shadow_rows))


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossClosure = Callable[[nn.Module], Tensor]


def _copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, the high-precision data inside torchao weight wrappers included: after a forward with
    gradients an MXFP8 training wrapper holds its ``_data`` as the output of torchao's ``unwrap_weight`` (a graph
    node, which ``deepcopy`` refuses: ``attach(shadow="model")`` raised on a model that had trained a step); the copy
    gets it as the leaf a fresh wrapper holds."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        data = getattr(parameter, "_data", None)
        if isinstance(data, Tensor) and not data.is_leaf:
            memo[id(data)] = data.detach().clone()
    return copy.deepcopy(model, memo)


class ShadowModel:
    """An FP32 copy of ``model`` with its own optimizer; ``monitored`` are the qualified names to de-quantize."""

    def __init__(self, model: nn.Module, monitored: Iterable[str], optimizer_factory: OptimizerFactory) -> None:
        from torch.ao.quantization import disable_fake_quant, disable_observer

        from quantwatch.agent.wrappers import named_modules

        self.model = _copy(model)
        modules = dict(named_modules(self.model))  # the monitored layers' names, as the monitor gives them
        for name in monitored:
            module = modules[name]
            reference_forward = getattr(module, "reference_forward", None)
            if callable(reference_forward):
                # Instance attribute: nn.Module.__call__ looks `forward` up on the instance first.
                module.forward = reference_forward
            else:
                module.apply(disable_fake_quant)
                module.apply(disable_observer)
        self.model.train(model.training)
        self.optimizer = optimizer_factory(self.model.parameters())
        self.weights = {
            name: w
            for name, module in modules.items()
            if isinstance(w := getattr(module, "weight", None), Tensor) and name in set(monitored)
        }

    def train_step(self, closure: LossClosure) -> Tensor:
        """One optimizer step of the shadow on ``closure(shadow_model)``; returns the detached loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = closure(self.model)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return loss.detach()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the shadow's state dict (loadable into the quantized model) to ``path``."""
        torch.save(self.model.state_dict(), path)
