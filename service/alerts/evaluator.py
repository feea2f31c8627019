"""The step-based alert state machine, free of I/O.

Two levels:

* a **series** — (rule, run, rank, layer) — walks inactive → pending → firing → (resolved) inactive, one reported
  sample at a time (:meth:`SeriesState.advance`). "Consecutive" counts reported samples of that series, so with a
  sampling period of 10 the steps 10, 20, 30 are consecutive. A sample whose step is not newer than the newest one
  evaluated is ignored: an older step is stored by ingest but does not rewind the streak, a repeated step is a
  duplicate;
* an **episode** — (rule, run, layer) across ranks — is what users are notified about (:func:`advance_episode`): it is
  pending while some rank is pending and none fires, firing from the moment any rank fires, and resolves when no rank
  fires any more. One notification when it fires, one when it resolves, however many ranks take part.

:func:`evaluate_batch` applies a rule set to one decoded batch of one rank and returns the new series states and the
series transitions in step order; the persistence layer turns those into episode events under a lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from quantwatch.service.alerts.rules import Rule, ScalarExpression, breaches

__all__ = [
    "EpisodeEvent",
    "SeriesState",
    "SeriesStatus",
    "SeriesTransition",
    "StepSample",
    "advance_episode",
    "evaluate_batch",
]


class SeriesStatus(str, Enum):
    """Where one series stands."""

    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"


@dataclass(frozen=True)
class SeriesState:
    """Persisted evaluator state of one series.

    ``streak`` counts consecutive breaching samples (the figure exported to Prometheus); ``clear_streak`` counts
    consecutive non-breaching samples while firing (for ``keep_firing_for``); ``last_step`` is the newest step
    evaluated, or ``None`` before the first sample.
    """

    status: SeriesStatus = SeriesStatus.INACTIVE
    last_step: int | None = None
    streak: int = 0
    clear_streak: int = 0
    last_value: float | None = None

    def advance(self, step: int, value: float, rule: Rule) -> SeriesState:
        """The state after one sample; ``self`` when the sample is a duplicate or older than ``last_step``."""
        if self.last_step is not None and step <= self.last_step:
            return self
        if breaches(value, rule.op, rule.threshold):
            streak = self.streak + 1
            if self.status is SeriesStatus.FIRING or streak >= rule.consecutive:
                status = SeriesStatus.FIRING
            else:
                status = SeriesStatus.PENDING
            return SeriesState(status, step, streak, 0, value)
        if self.status is SeriesStatus.FIRING:
            clear = self.clear_streak + 1
            if clear <= rule.keep_firing_for:
                return SeriesState(SeriesStatus.FIRING, step, 0, clear, value)
        return SeriesState(SeriesStatus.INACTIVE, step, 0, 0, value)


@dataclass(frozen=True)
class StepSample:
    """One reported value of one series at one step."""

    step: int
    time: float
    value: float


@dataclass(frozen=True)
class SeriesTransition:
    """A series changed status at a sample."""

    rule: str
    layer: str
    rank: int
    before: SeriesStatus
    after: SeriesStatus
    sample: StepSample


EpisodeState = Literal["pending", "firing"]


@dataclass(frozen=True)
class EpisodeEvent:
    """What happens to the (rule, run, layer) episode after a series transition.

    ``kind``: ``open`` (a new episode starts, in ``state``), ``fire`` (pending → firing), ``resolve`` (firing ends),
    ``cancel`` (a pending episode ends without ever firing: it is dropped, nobody was notified).
    """

    kind: Literal["open", "fire", "resolve", "cancel"]
    state: EpisodeState | None


def advance_episode(open_state: EpisodeState | None, statuses: Iterable[SeriesStatus]) -> list[EpisodeEvent]:
    """Episode events for the current statuses of every rank's series of one (rule, run, layer).

    ``open_state`` is the state of the open episode (``None`` when there is none). A firing episode resolves when no
    rank fires; a rank still pending at that moment opens the next episode (pending) straight away.
    """
    seen = list(statuses)
    any_firing = SeriesStatus.FIRING in seen
    any_pending = SeriesStatus.PENDING in seen
    if open_state is None:
        if any_firing:
            return [EpisodeEvent("open", "firing")]
        if any_pending:
            return [EpisodeEvent("open", "pending")]
        return []
    if open_state == "pending":
        if any_firing:
            return [EpisodeEvent("fire", "firing")]
        if any_pending:
            return []
        return [EpisodeEvent("cancel", None)]
    if any_firing:
        return []
    events = [EpisodeEvent("resolve", None)]
    if any_pending:
        events.append(EpisodeEvent("open", "pending"))
    return events


@dataclass(frozen=True)
class StepInput:
    """One step of a decoded batch: per-layer metric values aligned with the batch's layers, and scalars.

    A metric value of NaN stands for both "not measured" and "non-finite" on the wire's float32 arrays, so the
    caller passes not-measured values as ``None``.
    """

    step: int
    time: float
    metrics: Mapping[str, Sequence[float | None]]
    scalars: Mapping[str, float]


def _ordered_steps(steps: Sequence[StepInput]) -> list[StepInput]:
    # Within a batch, evaluate in step order; across batches, advance() drops what is not newer.
    return sorted(steps, key=lambda item: item.step)


SeriesKey = tuple[str, str]
"""(rule name, layer) within one (run, rank); scalar rules use the layer ``""``."""


def evaluate_batch(
    rules: Sequence[Rule],
    run: str,
    rank: int,
    layers: Sequence[str],
    steps: Sequence[StepInput],
    states: Mapping[SeriesKey, SeriesState],
) -> tuple[dict[SeriesKey, SeriesState], list[SeriesTransition]]:
    """Evaluate ``rules`` over one batch of one (run, rank).

    ``states`` holds the known series states (missing keys are inactive). Returns the states that changed (including
    ones whose ``last_step`` advanced) and every status transition, in step order per series.
    """
    ordered = _ordered_steps(steps)
    changed: dict[SeriesKey, SeriesState] = {}
    transitions: list[SeriesTransition] = []
    for rule in rules:
        if not rule.enabled or not rule.matches_run(run):
            continue
        if rule.metric is not None:
            metric = rule.metric
            for index, layer in enumerate(layers):
                if not rule.matches_layer(layer):
                    continue
                samples = [
                    StepSample(item.step, item.time, float(value))
                    for item in ordered
                    if metric in item.metrics and (value := item.metrics[metric][index]) is not None
                ]
                _walk(rule, rank, layer, samples, states, changed, transitions)
        else:
            expression: ScalarExpression = rule.expression()
            samples = []
            for item in ordered:
                value = expression.evaluate(item.scalars)
                if value is not None:
                    samples.append(StepSample(item.step, item.time, value))
            _walk(rule, rank, "", samples, states, changed, transitions)
    return changed, transitions


def _walk(
    rule: Rule,
    rank: int,
    layer: str,
    samples: list[StepSample],
    states: Mapping[SeriesKey, SeriesState],
    changed: dict[SeriesKey, SeriesState],
    transitions: list[SeriesTransition],
) -> None:
    if not samples:
        return
    key = (rule.name, layer)
    state = states.get(key, SeriesState())
    start = state
    for sample in samples:
        after = state.advance(sample.step, sample.value, rule)
        if after.status is not state.status:
            transitions.append(SeriesTransition(rule.name, layer, rank, state.status, after.status, sample))
        state = after
    if state != start:
        changed[key] = state
