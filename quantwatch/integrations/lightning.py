"""QuantWatch in a Lightning ``Trainer``: one callback.

```python
from quantwatch.integrations.lightning import QuantWatchCallback
trainer = lightning.Trainer(max_steps=1000, callbacks=[QuantWatchCallback(run="gpt-fp4", every=10)])
```

The callback attaches at ``on_fit_start`` to the LightningModule (layer names as in the module), reports each
optimizer step as ``trainer.global_step`` once it is taken (one step per optimizer step under
``accumulate_grad_batches``), with the training step's ``loss`` and the first optimizer's learning rate, and closes
when fitting ends. Once ``qw.actions.stop_training()`` took effect the callback sets ``trainer.should_stop``.
"""

from __future__ import annotations

from typing import Any

import lightning

from quantwatch.integrations._steps import StepRelay

__all__ = ["QuantWatchCallback"]


class QuantWatchCallback(lightning.pytorch.Callback):
    """Attach QuantWatch to the LightningModule a ``lightning.Trainer`` fits.

    ``run``, ``url`` and ``attach_options`` are :func:`quantwatch.agent.attach`'s; invalid ones raise
    :class:`~quantwatch.agent.ConfigError` here, not when fitting starts.
    """

    def __init__(self, run: str | None = None, url: str | None = None, **attach_options: Any) -> None:
        self._relay = StepRelay(run, url, attach_options)
        self._last_global_step = 0

    @property
    def monitor(self) -> Any:
        """The monitor attached to the module being fitted (None outside fitting)."""
        return self._relay.monitor

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        """Attach to the module; a resumed fit continues at the checkpoint's step."""
        self._last_global_step = trainer.global_step
        self._relay.attach(pl_module, first_step=trainer.global_step + 1)

    def on_train_batch_start(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Send the previous optimizer step before this batch's forward; stop the fit once
        ``qw.actions.stop_training()`` took effect there."""
        self._relay.send()
        if self._relay.should_stop():
            trainer.should_stop = True

    def on_train_batch_end(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Once the optimizer stepped, the step is finished: keep its loss and learning rate."""
        if trainer.global_step == self._last_global_step:
            return  # a micro-batch of gradient accumulation: the step goes on
        self._last_global_step = trainer.global_step
        self._relay.finished(trainer.global_step)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        scalars: dict[str, Any] = {"loss": loss} if loss is not None else {}
        if trainer.optimizers:
            scalars["learning_rate"] = trainer.optimizers[0].param_groups[0]["lr"]
        self._relay.scalars(scalars)

    def on_fit_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        """Send the last step and close the monitor."""
        self._relay.close()
