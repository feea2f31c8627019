"""What both trainer callbacks share: options checked up front, one monitor per fit, one ``monitor.step`` per optimizer
step with the scalars the trainer reported for it, and tokens counted where the trainer does not count them."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.options import check_attach_options


class StepRelay:
    """Holds the step a trainer just finished until its scalars are in, then hands both to the monitor.

    Trainers report a step's loss and learning rate after their "step end" event, so the step is sent when the next
    one begins (before its forward, so the agent's hooks are armed in time) or when training ends.
    """

    def __init__(self, run: str | None, url: str | None, options: dict[str, Any]) -> None:
        check_attach_options(run=run, url=url, **options)
        self._attach = {"run": run, "url": url, **options}
        self.monitor: qw.Monitor | None = None
        self._pending: int | None = None
        self._scalars: dict[str, Any] = {}  # float or one-element Tensor, read on the exporter thread
        self._tokens_total: float | None = None
        self._tokens_at_last_step: float | None = None
        self._counted_tokens = 0
        self._counter: Any = None

    def attach(self, model: nn.Module, *, first_step: int, tokens_seen: float | None = None) -> None:
        """Attach to ``model`` once per fit; the first step the trainer will finish is ``first_step``.

        ``tokens_seen`` is the trainer's running token count where it keeps one; otherwise the tokens of the model's
        ``input_ids`` are counted here."""
        if self.monitor is not None:
            return
        self.monitor = qw.attach(model, **self._attach)
        self.monitor.expect_step(first_step)
        self._tokens_at_last_step = tokens_seen
        if tokens_seen is None:
            self._counter = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)

    def _count_tokens(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, Tensor):
            self._counted_tokens += ids.numel()

    def finished(self, step: int, tokens_seen: float | None = None) -> None:
        """The trainer finished optimizer step ``step`` (``tokens_seen``: its running token count, if it keeps one)."""
        self.send()
        self._pending = step
        self._tokens_total = tokens_seen

    def scalars(self, values: dict[str, Any]) -> None:
        """Scalars the trainer logged for the step it just finished."""
        for name, value in values.items():
            if isinstance(value, Tensor) and value.numel() == 1:
                self._scalars[name] = value.detach()
            elif isinstance(value, int | float) and not isinstance(value, bool):
                self._scalars[name] = float(value)

    def send(self) -> None:
        """Hand the pending step and its scalars to the monitor (no-op when none is pending)."""
        if self.monitor is None or self._pending is None:
            return
        tokens: float | None = None
        if self._tokens_total is not None:
            if self._tokens_at_last_step is not None:
                tokens = self._tokens_total - self._tokens_at_last_step
            self._tokens_at_last_step = self._tokens_total
        elif self._counter is not None:
            tokens, self._counted_tokens = float(self._counted_tokens), 0
        self.monitor.step(self._pending, tokens=tokens, **self._scalars)
        self._pending = None
        self._scalars = {}

    def should_stop(self) -> bool:
        """Whether ``qw.actions.stop_training()`` took effect on the monitor."""
        return self.monitor is not None and self.monitor.should_stop

    def close(self) -> None:
        """Send the last step and close the monitor (its figures are flushed)."""
        self.send()
        if self._counter is not None:
            self._counter.remove()
            self._counter = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
