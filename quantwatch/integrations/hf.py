"""QuantWatch in a Hugging Face ``transformers.Trainer``: one callback, no training loop to write.

```python
from quantwatch.integrations.hf import QuantWatchCallback
trainer = Trainer(model, args, train_dataset=data, callbacks=[QuantWatchCallback(run="llama-fp8", every=10)])
```

The callback attaches at ``on_train_begin`` to the model the Trainer trains (after accelerate prepared it, so an FP8
conversion made there is what is watched), reports each optimizer step as ``state.global_step`` (one step per
optimizer step under gradient accumulation: the micro-batches' figures are combined), with the ``loss``,
``learning_rate`` and ``grad_norm`` of ``on_log`` and ``tokens_per_second`` (from ``num_input_tokens_seen`` when the
Trainer counts tokens, else counted from ``input_ids``), and closes at ``on_train_end``. A run resumed from a
checkpoint goes on with the same run name and step numbers; re-sent steps replace what was stored. Once
``qw.actions.stop_training()`` took effect the callback sets ``control.should_training_stop``.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from quantwatch.integrations._steps import StepRelay

__all__ = ["QuantWatchCallback"]

# What on_log reports, under the names QuantWatch stores.
_LOGGED = {"loss": "loss", "learning_rate": "learning_rate", "grad_norm": "grad_norm"}


class QuantWatchCallback(TrainerCallback):
    """Attach QuantWatch to the model a ``transformers.Trainer`` trains.

    ``run``, ``url`` and ``attach_options`` are :func:`quantwatch.agent.attach`'s; invalid ones raise
    :class:`~quantwatch.agent.ConfigError` here, not when training starts. ``monitor`` is the live
    :class:`~quantwatch.agent.Monitor` between ``on_train_begin`` and ``on_train_end``.
    """

    def __init__(self, run: str | None = None, url: str | None = None, **attach_options: Any) -> None:
        self._relay = StepRelay(run, url, attach_options)

    @property
    def monitor(self) -> Any:
        """The monitor attached to the trained model (None outside training)."""
        return self._relay.monitor

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Attach to the model being trained; a resumed run continues at the checkpoint's step."""
        tokens = float(state.num_input_tokens_seen) if args.include_num_input_tokens_seen != "no" else None
        self._relay.attach(kwargs["model"], first_step=state.global_step + 1, tokens_seen=tokens)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Send the previous step (its scalars are in by now) before this step's forward; stop the Trainer once
        ``qw.actions.stop_training()`` took effect there."""
        self._relay.send()
        control.should_training_stop = control.should_training_stop or self._relay.should_stop()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """An optimizer step finished: it is sent once its logged scalars arrived."""
        tokens = float(state.num_input_tokens_seen) if args.include_num_input_tokens_seen != "no" else None
        self._relay.finished(state.global_step, tokens_seen=tokens)
        control.should_training_stop = control.should_training_stop or self._relay.should_stop()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Keep the loss, learning rate and gradient norm the Trainer logged for the step that just finished."""
        logs = logs or {}
        self._relay.scalars({ours: logs[theirs] for theirs, ours in _LOGGED.items() if theirs in logs})

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Send the last step and close the monitor."""
        self._relay.close()
