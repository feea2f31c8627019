"""The full FP32 shadow model (``shadow="model"``): a copy of the model without quantization, trained in lockstep.

Every monitored layer of the copy runs its FP32 reference instead of its quantized forward (``reference_forward`` for
protocol modules, fake quantizers switched off for QAT modules).  Each step the user's loss closure runs on the copy,
which is trained by its own optimizer, so ``loss_shadow`` and the per-layer ``weight_drift_rel_l2`` show how far
the quantized run has walked away from the full-precision baseline, and :meth:`ShadowModel.save` writes an FP32
checkpoint (same state-dict keys as the model) to roll back to.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

__all__ = ["ShadowModel"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossClosure = Callable[[nn.Module], Tensor]


class ShadowModel:
    """An FP32 copy of ``model`` with its own optimizer; ``monitored`` are the qualified names to de-quantize."""

    def __init__(self, model: nn.Module, monitored: Iterable[str], optimizer_factory: OptimizerFactory) -> None:
        from torch.ao.quantization import disable_fake_quant, disable_observer

        from quantwatch.agent.wrappers import named_modules

        self.model = copy.deepcopy(model)
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
