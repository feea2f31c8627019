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
series transitions in step order; the persistence layer turns those into episode events under a lock. It is the
definition, one sample at a time. The ingest path computes the same result by column
(:mod:`quantwatch.service.alerts.columns`); tests hold the two equal on randomized batches.

A rule may select layers by their number format (:class:`LayerFormatView`: each layer's current format per tensor
kind). A baseline-relative rule (``baseline:``) judges a sample only once the series has collected its first
``samples`` samples, and breaches when the sample also exceeds ``factor`` × their median (``1 - cosine`` for a
cosine); the collected samples start again at a change of the layer's format. Those rules take the per-sample path.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import numpy as np
import numpy.typing as npt

from quantwatch.service.alerts.rules import Rule, ScalarExpression, breaches

__all__ = [
    "BatchColumns",
    "EpisodeEvent",
    "LayerFormatView",
    "MetricColumn",
    "SeriesState",
    "SeriesStatus",
    "SeriesTransition",
    "StepSample",
    "advance_episode",
    "evaluate_batch",
    "walk_samples",
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
    evaluated, or ``None`` before the first sample. A baseline rule's ``baseline`` holds the deviations of the
    series' first samples since the format change at step ``baseline_since`` (``None``: no change recorded).
    """

    status: SeriesStatus = SeriesStatus.INACTIVE
    last_step: int | None = None
    streak: int = 0
    clear_streak: int = 0
    last_value: float | None = None
    baseline: tuple[float, ...] = ()
    baseline_since: int | None = None

    def advance(self, step: int, value: float, rule: Rule, epoch: int | None = None) -> SeriesState:
        """The state after one sample; ``self`` when the sample is a duplicate or older than ``last_step``.

        ``epoch`` is the step of the layer's latest format change at or before ``step`` (``None``: none recorded).
        """
        if self.last_step is not None and step <= self.last_step:
            return self
        baseline, since = self.baseline, self.baseline_since
        if rule.baseline is None:
            breach = breaches(value, rule.op, rule.threshold)
        else:
            if epoch is not None and (since is None or epoch > since):
                baseline, since = (), epoch  # the format changed: the series' reference starts again
            breach, baseline = _judge_against_baseline(rule, value, baseline)
        if breach:
            streak = self.streak + 1
            if self.status is SeriesStatus.FIRING or streak >= rule.consecutive:
                status = SeriesStatus.FIRING
            else:
                status = SeriesStatus.PENDING
            return SeriesState(status, step, streak, 0, value, baseline, since)
        if self.status is SeriesStatus.FIRING:
            clear = self.clear_streak + 1
            if clear <= rule.keep_firing_for:
                return SeriesState(SeriesStatus.FIRING, step, 0, clear, value, baseline, since)
        return SeriesState(SeriesStatus.INACTIVE, step, 0, 0, value, baseline, since)


def _judge_against_baseline(rule: Rule, value: float, baseline: tuple[float, ...]) -> tuple[bool, tuple[float, ...]]:
    """(breach, baseline after the sample) for a baseline rule: collect the first samples, then compare."""
    spec = rule.baseline
    if spec is None:
        raise ValueError(f"rule {rule.name!r} has no baseline")
    if not math.isfinite(value):
        return True, baseline  # non-finite breaches every rule and never enters a baseline
    deviation = rule.deviation(value)
    if len(baseline) < spec.samples:
        return False, (*baseline, deviation)
    bound = spec.factor * statistics.median(baseline)
    return breaches(value, rule.op, rule.threshold) and deviation > bound, baseline


LayerKinds = tuple[frozenset[tuple[str, str]] | None, ...]
"""Per layer, its formats as (kind, format) pairs, or None."""


@dataclass(frozen=True)
class LayerFormatView:
    """The formats a batch's layers are evaluated under.

    ``current``: each layer's current format per tensor kind (layers of unknown format absent); ``changes``: per
    layer, the steps at which its format changed, in order.
    """

    current: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    changes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    _by_layers: dict[tuple[str, ...], LayerKinds] = field(default_factory=dict, compare=False, repr=False)

    def kinds_by_layer(self, layers: tuple[str, ...]) -> LayerKinds:
        """Each of ``layers``' current formats as a set of (kind, format) pairs (None: unknown), made once per layer
        list: a run sends the same list in every batch, and rebuilding it per rule and batch cost a tenth of a
        one-step batch."""
        found = self._by_layers.get(layers)
        if found is None:
            found = tuple(frozenset(kinds.items()) if (kinds := self.current.get(layer)) else None for layer in layers)
            self._by_layers[layers] = found
        return found


def _epoch(changes: tuple[int, ...], step: int) -> int | None:
    position = bisect.bisect_right(changes, step)
    return changes[position - 1] if position else None


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
    formats: LayerFormatView | None = None,
) -> tuple[dict[SeriesKey, SeriesState], list[SeriesTransition]]:
    """Evaluate ``rules`` over one batch of one (run, rank).

    ``states`` holds the known series states (missing keys are inactive); ``formats`` the layers' formats (none
    known without it). Returns the states that changed (including ones whose ``last_step`` advanced) and every
    status transition, in step order per series.
    """
    formats = formats or LayerFormatView()
    ordered = _ordered_steps(steps)
    changed: dict[SeriesKey, SeriesState] = {}
    transitions: list[SeriesTransition] = []
    for rule in rules:
        if not rule.enabled or not rule.matches_run(run):
            continue
        if rule.metric is not None:
            metric = rule.metric
            for index, layer in enumerate(layers):
                if not rule.matches_layer(layer, formats.current.get(layer)):
                    continue
                samples = [
                    StepSample(item.step, item.time, float(value))
                    for item in ordered
                    if metric in item.metrics and (value := item.metrics[metric][index]) is not None
                ]
                walk_samples(rule, rank, layer, samples, states, changed, transitions, formats.changes.get(layer, ()))
        else:
            expression: ScalarExpression = rule.expression()
            samples = []
            for item in ordered:
                value = expression.evaluate(item.scalars)
                if value is not None:
                    samples.append(StepSample(item.step, item.time, value))
            walk_samples(rule, rank, "", samples, states, changed, transitions)
    return changed, transitions


def walk_samples(
    rule: Rule,
    rank: int,
    layer: str,
    samples: list[StepSample],
    states: Mapping[SeriesKey, SeriesState],
    changed: dict[SeriesKey, SeriesState],
    transitions: list[SeriesTransition],
    format_changes: tuple[int, ...] = (),
) -> None:
    """Advance one series over its ``samples`` (in step order): its state into ``changed`` when it changed, its status
    transitions appended."""
    if not samples:
        return
    key = (rule.name, layer)
    state = states.get(key, SeriesState())
    start = state
    for sample in samples:
        after = state.advance(sample.step, sample.value, rule, _epoch(format_changes, sample.step))
        if after.status is not state.status:
            transitions.append(SeriesTransition(rule.name, layer, rank, state.status, after.status, sample))
        state = after
    if state != start:
        changed[key] = state


Bools = npt.NDArray[np.bool_]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class MetricColumn:
    """One metric over a batch: ``values[row, layer]`` as float64 and whether each value was ``measured``."""

    values: F64
    measured: Bools


@dataclass(frozen=True)
class BatchColumns:
    """A batch of one (run, rank) by column: the step and time of each row, per-metric matrices, per-row scalars.

    Rows are in the order the batch listed its steps; :func:`evaluate_columns` walks them in step order.
    ``formats`` are the layers' formats (none known without them).
    """

    steps: tuple[int, ...]
    times: tuple[float, ...]
    metrics: Mapping[str, MetricColumn]
    scalars: tuple[Mapping[str, float], ...]
    formats: LayerFormatView | None = None

    @classmethod
    def from_steps(cls, n_layers: int, steps: Sequence[StepInput], metrics: Iterable[str]) -> BatchColumns:
        """The columns of ``metrics`` (others are left out) from per-step inputs; ``None`` is not measured."""
        columns: dict[str, MetricColumn] = {}
        for name in metrics:
            values = np.full((len(steps), n_layers), np.nan)
            measured = np.zeros((len(steps), n_layers), dtype=bool)
            for row, item in enumerate(steps):
                listed = item.metrics.get(name)
                if listed is None:
                    continue
                for index, value in enumerate(listed):
                    if value is not None:
                        values[row, index] = value
                        measured[row, index] = True
            columns[name] = MetricColumn(values, measured)
        return cls(
            tuple(item.step for item in steps),
            tuple(item.time for item in steps),
            columns,
            tuple(item.scalars for item in steps),
        )
