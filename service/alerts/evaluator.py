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
definition, one sample at a time. :func:`evaluate_columns` computes the same result for metric rules with numpy, one
step row of all layers at a time (the ingest path: 512 layers × 16 steps per batch); tests hold it to
:func:`evaluate_batch` on randomized batches.

A rule may select layers by their number format (:class:`LayerFormatView`: each layer's current format per tensor
kind). A baseline-relative rule (``baseline:``) judges a sample only once the series has collected its first
``samples`` samples, and breaches when the sample also exceeds ``factor`` × their median (``1 - cosine`` for a
cosine); the collected samples start again at a change of the layer's format. Those rules take the per-sample path.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import numpy as np
import numpy.typing as npt

from quantwatch.service.alerts.rules import Rule, ScalarExpression, breaches
from quantwatch.service.alerts.specs import Selection, selects_layer

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
    "evaluate_columns",
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


@dataclass(frozen=True)
class LayerFormatView:
    """The formats a batch's layers are evaluated under.

    ``current``: each layer's current format per tensor kind (layers of unknown format absent); ``changes``: per
    layer, the steps at which its format changed, in order.
    """

    current: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    changes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


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
                _walk(rule, rank, layer, samples, states, changed, transitions, formats.changes.get(layer, ()))
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
    format_changes: tuple[int, ...] = (),
) -> None:
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


_COMPARE: dict[str, Callable[[F64, float], Bools]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_STATUSES = (SeriesStatus.INACTIVE, SeriesStatus.PENDING, SeriesStatus.FIRING)
_INACTIVE, _PENDING, _FIRING = 0, 1, 2
_CODES = {status: code for code, status in enumerate(_STATUSES)}


def evaluate_columns(
    rules: Sequence[Rule],
    run: str,
    rank: int,
    layers: Sequence[str],
    columns: BatchColumns,
    states: Mapping[SeriesKey, SeriesState],
) -> tuple[dict[SeriesKey, SeriesState], list[SeriesTransition]]:
    """:func:`evaluate_batch` over a batch by column: metric rules advance every layer of a step row at once.

    Same arguments and result as :func:`evaluate_batch` (``columns`` in place of per-step inputs); scalar rules, a
    handful of samples per batch, take the per-sample path.
    """
    order = sorted(range(len(columns.steps)), key=columns.steps.__getitem__)
    changed: dict[SeriesKey, SeriesState] = {}
    transitions: list[SeriesTransition] = []
    formats = columns.formats or LayerFormatView()
    by_layer: tuple[frozenset[tuple[str, str]] | None, ...] | None = None
    for rule in rules:
        if not rule.enabled or not rule.matches_run(run):
            continue
        if rule.metric is None:
            expression = rule.expression()
            samples = []
            for row in order:
                value = expression.evaluate(columns.scalars[row])
                if value is not None:
                    samples.append(StepSample(columns.steps[row], columns.times[row], value))
            _walk(rule, rank, "", samples, states, changed, transitions)
            continue
        column = columns.metrics.get(rule.metric)
        if column is None:
            continue
        if rule.selects_formats and by_layer is None:
            by_layer = tuple(
                frozenset(kinds.items()) if (kinds := formats.current.get(layer)) else None for layer in layers
            )
        selected = list(_matching_layers(rule.selection, tuple(layers), by_layer if rule.selects_formats else None))
        if rule.baseline is not None:
            for index in selected:
                samples = [
                    StepSample(columns.steps[row], columns.times[row], float(column.values[row, index]))
                    for row in order
                    if column.measured[row, index]
                ]
                changes = formats.changes.get(layers[index], ())
                _walk(rule, rank, layers[index], samples, states, changed, transitions, changes)
        elif selected:
            _walk_columns(
                rule,
                rank,
                [layers[i] for i in selected],
                column,
                selected,
                order,
                columns,
                states,
                changed,
                transitions,
            )
    return changed, transitions


@functools.lru_cache(maxsize=256)
def _matching_layers(
    selection: Selection, layers: tuple[str, ...], formats: tuple[frozenset[tuple[str, str]] | None, ...] | None
) -> tuple[int, ...]:
    # A run sends the same layer list (and formats) in every batch: match each rule's selection against it once.
    return tuple(
        index
        for index, layer in enumerate(layers)
        if selects_layer(selection, layer, dict(formats[index] or ()) if formats is not None else None)
    )


def _walk_columns(
    rule: Rule,
    rank: int,
    names: list[str],
    column: MetricColumn,
    selected: list[int],
    order: list[int],
    columns: BatchColumns,
    states: Mapping[SeriesKey, SeriesState],
    changed: dict[SeriesKey, SeriesState],
    transitions: list[SeriesTransition],
) -> None:
    """:meth:`SeriesState.advance` for every selected layer at once, one step row at a time (see there)."""
    count = len(names)
    before = [states.get((rule.name, name)) for name in names]
    status = np.array([_CODES[s.status] if s is not None else _INACTIVE for s in before], dtype=np.int8)
    streak = np.array([s.streak if s is not None else 0 for s in before], dtype=np.int64)
    clear = np.array([s.clear_streak if s is not None else 0 for s in before], dtype=np.int64)
    seen = np.array([s is not None and s.last_step is not None for s in before], dtype=bool)
    last = np.array([s.last_step if s is not None and s.last_step is not None else 0 for s in before], dtype=np.int64)
    last_value = np.full(count, np.nan)
    accepted_any = np.zeros(count, dtype=bool)
    compare = _COMPARE[rule.op]
    whole = len(selected) == column.values.shape[1]
    moves: list[tuple[int, int, int, int, float]] = []  # (series, row, before, after, value)
    for row in order:
        step = columns.steps[row]
        values = column.values[row] if whole else column.values[row, selected]
        measured = column.measured[row] if whole else column.measured[row, selected]
        # A sample counts when measured and newer than the series' newest evaluated step (older: ignored).
        accepted = measured & (~seen | (last < step))
        if not accepted.any():
            continue
        with np.errstate(invalid="ignore"):
            breach = accepted & (~np.isfinite(values) | compare(values, rule.threshold))
        calm = accepted & ~breach
        firing = status == _FIRING
        grown = streak + 1
        kept = calm & firing & (clear + 1 <= rule.keep_firing_for)
        after = np.where(
            breach,
            np.where(firing | (grown >= rule.consecutive), _FIRING, _PENDING),
            np.where(kept, _FIRING, np.where(calm, _INACTIVE, status)),
        ).astype(np.int8)
        for series in np.flatnonzero(after != status).tolist():
            moves.append((series, row, int(status[series]), int(after[series]), float(values[series])))
        status = after
        streak = np.where(breach, grown, np.where(calm, 0, streak))
        clear = np.where(kept, clear + 1, np.where(accepted, 0, clear))
        last = np.where(accepted, step, last)
        last_value = np.where(accepted, values, last_value)
        seen |= accepted
        accepted_any |= accepted
    # Same order as the per-sample walk: by series, then by step.
    moves.sort(key=lambda move: move[0])
    for series, row, old, new, value in moves:
        sample = StepSample(columns.steps[row], columns.times[row], value)
        transitions.append(SeriesTransition(rule.name, names[series], rank, _STATUSES[old], _STATUSES[new], sample))
    finals = zip(
        np.flatnonzero(accepted_any).tolist(),
        status[accepted_any].tolist(),
        last[accepted_any].tolist(),
        streak[accepted_any].tolist(),
        clear[accepted_any].tolist(),
        last_value[accepted_any].tolist(),
        strict=True,
    )
    for series, code, step, run_length, clear_length, value in finals:
        changed[(rule.name, names[series])] = _quick_state(_STATUSES[code], step, run_length, clear_length, value)


_new = object.__new__


def _quick_state(status: SeriesStatus, step: int, streak: int, clear: int, value: float) -> SeriesState:
    """``SeriesState(status, step, streak, clear, value)`` without the frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field): ~2.5× faster for the 512 states a one-step batch of a 512-layer model moves."""
    state = _new(SeriesState)
    state.__dict__.update(
        status=status,
        last_step=step,
        streak=streak,
        clear_streak=clear,
        last_value=value,
        baseline=(),
        baseline_since=None,
    )
    return state
