"""The alert state of one (rule, run, rank) by column, and the batch evaluation over it.

A metric rule's state for all the layers of a rank is one :class:`ColumnStates`: numpy arrays (status, newest step,
streak, clear streak, last value) over its layers, advanced with vectorised operations one step row of the batch at a
time and stored as a few compressed arrays (:mod:`~quantwatch.service.alerts.state_codec`), not one Python object
per (rule, layer).
Baseline rules (a variable-length reference per series) and scalar rules (one series) keep the per-sample path and
its :class:`~quantwatch.service.alerts.evaluator.SeriesState` mapping. :func:`evaluate_rows` is the ingest path;
:func:`evaluate_columns` gives the same result keyed per series (tests hold it to
:func:`~quantwatch.service.alerts.evaluator.evaluate_batch` on randomized batches).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from quantwatch.service.alerts.evaluator import (
    BatchColumns,
    LayerFormatView,
    LayerKinds,
    MetricColumn,
    SeriesKey,
    SeriesState,
    SeriesStatus,
    SeriesTransition,
    StepSample,
    walk_samples,
)
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.specs import Selection, selects_layer
from quantwatch.service.alerts.state_codec import COLUMNS_TAG, decode_columns, encode_columns
from quantwatch.service.alerts.tables import SERIES_STATUSES

__all__ = [
    "COLUMNS_TAG",
    "STATUSES",
    "STATUS_CODES",
    "ColumnStates",
    "RankBatch",
    "RuleStates",
    "evaluate_columns",
    "evaluate_rows",
    "stored_statuses",
]

Bools = npt.NDArray[np.bool_]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

STATUSES = tuple(SeriesStatus(name) for name in SERIES_STATUSES)
"""Each stored status code's status (both stored forms: a code is the index in :data:`SERIES_STATUSES`)."""
STATUS_CODES = {status: code for code, status in enumerate(STATUSES)}
"""Each status's stored code."""
_INACTIVE, _PENDING, _FIRING = (
    STATUS_CODES[status] for status in (SeriesStatus.INACTIVE, SeriesStatus.PENDING, SeriesStatus.FIRING)
)
_COMPARE: dict[str, Callable[[F64, float], Bools]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


@dataclass(frozen=True, eq=False)
class ColumnStates(Mapping[SeriesKey, SeriesState]):
    """The states of one metric rule's series of one (run, rank), one array entry per layer.

    ``seen[i]``: layer ``layers[i]`` has a series (a sample was evaluated); the other arrays hold its fields. As a
    mapping it reads like the per-series states (keys (rule, layer) of the seen layers), with a non-finite last
    value read as ``None``, as stored.
    """

    rule: str
    layers: tuple[str, ...]
    seen: Bools
    status: npt.NDArray[np.int8]
    last: I64
    streak: I64
    clear: I64
    last_value: F64

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """Position of each layer."""
        return {layer: position for position, layer in enumerate(self.layers)}

    def state(self, position: int) -> SeriesState:
        """The state of the layer at ``position`` (a non-finite last value kept as it is)."""
        return SeriesState(
            STATUSES[int(self.status[position])],
            int(self.last[position]),
            int(self.streak[position]),
            int(self.clear[position]),
            float(self.last_value[position]),
        )

    def __getitem__(self, key: SeriesKey) -> SeriesState:
        position = self.index.get(key[1]) if key[0] == self.rule else None
        if position is None or not self.seen[position]:
            raise KeyError(key)
        state = self.state(position)
        value = state.last_value
        return state if value is not None and math.isfinite(value) else dataclasses.replace(state, last_value=None)

    def __iter__(self) -> Iterator[SeriesKey]:
        return ((self.rule, self.layers[position]) for position in np.flatnonzero(self.seen).tolist())

    def __len__(self) -> int:
        return int(self.seen.sum())

    @classmethod
    def empty(cls, rule: str, layers: Sequence[str]) -> ColumnStates:
        """No series yet for ``layers``."""
        count = len(layers)
        zeros = np.zeros(count, dtype=np.int64)
        return cls(
            rule,
            tuple(layers),
            np.zeros(count, dtype=bool),
            np.zeros(count, dtype=np.int8),
            zeros,
            zeros,
            zeros,
            np.full(count, np.nan),
        )

    @classmethod
    def from_states(cls, rule: str, states: Mapping[SeriesKey, SeriesState]) -> ColumnStates:
        """The columns of per-series states (those of other rules left out; a series not yet evaluated is unseen)."""
        if isinstance(states, ColumnStates) and states.rule == rule:
            return states
        mine = [(layer, state) for (name, layer), state in states.items() if name == rule]
        return cls(
            rule,
            tuple(layer for layer, _ in mine),
            np.array([state.last_step is not None for _, state in mine], dtype=bool),
            np.array([STATUS_CODES[state.status] for _, state in mine], dtype=np.int8),
            np.array([state.last_step or 0 for _, state in mine], dtype=np.int64),
            np.array([state.streak for _, state in mine], dtype=np.int64),
            np.array([state.clear_streak for _, state in mine], dtype=np.int64),
            np.array([state.last_value for _, state in mine], dtype=np.float64),
        )

    def encode(self) -> list[Any]:
        """The stored row (version 2 of :mod:`~quantwatch.service.alerts.state_codec`)."""
        return encode_columns((self.layers, *self._arrays()))

    @classmethod
    def decode(cls, rule: str, fields: Sequence[Any]) -> ColumnStates:
        """The states of a stored row of either version of :mod:`~quantwatch.service.alerts.state_codec`."""
        return cls(rule, *decode_columns(fields))

    def covering(self, names: Sequence[str]) -> tuple[ColumnStates, npt.NDArray[np.intp] | None]:
        """These states extended by the layers of ``names`` they lack, and the position of each name in them
        (``None``: ``names`` are exactly the layers, in order — the usual case, a run sends the same layers)."""
        if tuple(names) == self.layers:
            return self, None
        added = [name for name in dict.fromkeys(names) if name not in self.index]
        states = self
        if added:
            extra = ColumnStates.empty(self.rule, added)
            states = ColumnStates(
                self.rule,
                (*self.layers, *added),
                *(np.concatenate([mine, theirs]) for mine, theirs in zip(self._arrays(), extra._arrays(), strict=True)),
            )
        return states, np.array([states.index[name] for name in names], dtype=np.intp)

    def _arrays(self) -> tuple[Any, ...]:
        return self.seen, self.status, self.last, self.streak, self.clear, self.last_value


def stored_statuses(series: Mapping[str, list[Any]] | Sequence[Any], layers: Sequence[str]) -> dict[str, int]:
    """The status codes of the series of ``layers`` in a stored row of any form (layers without one left out)."""
    if isinstance(series, Mapping):
        return {layer: fields[0] for layer in layers if (fields := series.get(layer)) is not None}
    names, seen, status, *_ = decode_columns(series)
    wanted = set(layers)
    return {name: int(status[i]) for i, name in enumerate(names) if name in wanted and seen[i]}


RuleStates = Mapping[SeriesKey, SeriesState]
"""One rule's stored states of one (run, rank): a :class:`ColumnStates` or per-series states."""


@dataclass(frozen=True)
class RankBatch:
    """One batch of one (run, rank) by column: what each rule advances over."""

    run: str
    rank: int
    layers: Sequence[str]
    columns: BatchColumns


def evaluate_rows(
    rules: Sequence[Rule], batch: RankBatch, rows: Mapping[str, RuleStates]
) -> tuple[dict[str, RuleStates], list[SeriesTransition]]:
    """Evaluate ``rules`` over ``batch`` given each rule's stored states (``rows``, by rule name).

    Returns the complete states of every rule a sample advanced (the rows to write) and every status transition, in
    step order per series. Metric rules without a baseline advance every selected layer of a step row at once.
    """
    written: dict[str, RuleStates] = {}
    transitions: list[SeriesTransition] = []
    for rule, stored, moved in _advance(rules, batch, lambda rule: rows.get(rule.name, {}), transitions):
        written[rule.name] = moved[0] if isinstance(moved, tuple) else {**stored, **moved}
    return written, transitions


def evaluate_columns(
    rules: Sequence[Rule],
    run: str,
    rank: int,
    layers: Sequence[str],
    columns: BatchColumns,
    states: Mapping[SeriesKey, SeriesState],
) -> tuple[dict[SeriesKey, SeriesState], list[SeriesTransition]]:
    """:func:`~quantwatch.service.alerts.evaluator.evaluate_batch` over a batch by column: the same arguments
    (``columns`` in place of per-step inputs) and result, the states that changed keyed per series."""
    changed: dict[SeriesKey, SeriesState] = {}
    transitions: list[SeriesTransition] = []
    batch = RankBatch(run, rank, layers, columns)
    for _, _, moved in _advance(rules, batch, lambda _: states, transitions):
        if isinstance(moved, tuple):
            after, names, accepted = moved
            changed.update(
                ((after.rule, names[i]), after.state(after.index[names[i]])) for i in np.flatnonzero(accepted).tolist()
            )
        else:
            changed.update(moved)
    return changed, transitions


_Moved = tuple[ColumnStates, tuple[str, ...], Bools] | dict[SeriesKey, SeriesState]


def _advance(
    rules: Sequence[Rule],
    batch: RankBatch,
    states_of: Callable[[Rule], RuleStates],
    transitions: list[SeriesTransition],
) -> Iterator[tuple[Rule, RuleStates, _Moved]]:
    """(rule, its states before, what moved) for every rule a sample advanced, transitions appended: a columnar
    rule's states after and the series advanced, or the per-sample path's changed states."""
    run, rank, layers, columns = batch.run, batch.rank, batch.layers, batch.columns
    order = sorted(range(len(columns.steps)), key=columns.steps.__getitem__)
    formats = columns.formats or LayerFormatView()
    for rule in rules:
        if not rule.enabled or not rule.matches_run(run):
            continue
        stored = states_of(rule)
        if rule.metric is not None and rule.baseline is None:
            moved = _rule_columns(rule, rank, layers, columns, order, formats, stored, transitions)
            if moved is not None:
                yield rule, stored, moved
            continue
        changed: dict[SeriesKey, SeriesState] = {}
        for layer, samples, format_changes in _per_sample(rule, layers, columns, order, formats):
            walk_samples(rule, rank, layer, samples, stored, changed, transitions, format_changes)
        if changed:
            yield rule, stored, changed


def _per_sample(
    rule: Rule, layers: Sequence[str], columns: BatchColumns, order: list[int], formats: LayerFormatView
) -> Iterator[tuple[str, list[StepSample], tuple[int, ...]]]:
    """(layer, samples in step order, the layer's format changes) of a scalar or baseline rule."""
    if rule.metric is None:
        expression = rule.expression()
        samples = []
        for row in order:
            value = expression.evaluate(columns.scalars[row])
            if value is not None:
                samples.append(StepSample(columns.steps[row], columns.times[row], value))
        yield "", samples, ()
        return
    column = columns.metrics.get(rule.metric)
    if column is None:
        return
    for index in _selected(rule, layers, formats).indices:
        samples = [
            StepSample(columns.steps[row], columns.times[row], float(column.values[row, index]))
            for row in order
            if column.measured[row, index]
        ]
        yield layers[index], samples, formats.changes.get(layers[index], ())


@dataclass(frozen=True)
class _Match:
    """The layers of a batch a rule selects: their positions (as a tuple and as an index array) and names."""

    indices: tuple[int, ...]
    positions: npt.NDArray[np.intp]
    names: tuple[str, ...]


def _selected(rule: Rule, layers: Sequence[str], formats: LayerFormatView) -> _Match:
    names = tuple(layers)
    return _matching_layers(rule.selection, names, formats.kinds_by_layer(names) if rule.selects_formats else None)


@functools.lru_cache(maxsize=256)
def _matching_layers(selection: Selection, layers: tuple[str, ...], formats: LayerKinds | None) -> _Match:
    # A run sends the same layer list (and formats) in every batch: match each rule's selection against it once.
    indices = tuple(
        index
        for index, layer in enumerate(layers)
        if selects_layer(selection, layer, dict(formats[index] or ()) if formats is not None else None)
    )
    return _Match(indices, np.array(indices, dtype=np.intp), tuple(layers[i] for i in indices))


def _rule_columns(
    rule: Rule,
    rank: int,
    layers: Sequence[str],
    columns: BatchColumns,
    order: list[int],
    formats: LayerFormatView,
    stored: Mapping[SeriesKey, SeriesState],
    transitions: list[SeriesTransition],
) -> tuple[ColumnStates, tuple[str, ...], Bools] | None:
    """Advance one metric rule's columns over the batch: (all its states after, the selected layers, which of them a
    sample advanced), or ``None`` when no sample counted."""
    column = columns.metrics.get(str(rule.metric))
    if column is None:
        return None
    match = _selected(rule, layers, formats)
    if not match.indices:
        return None
    states, positions = ColumnStates.from_states(rule.name, stored).covering(match.names)
    after, accepted = _walk_columns(rule, rank, match, column, order, columns, states, positions, transitions)
    if not accepted.any():
        return None
    return after, match.names, accepted


def _walk_columns(
    rule: Rule,
    rank: int,
    match: _Match,
    column: MetricColumn,
    order: list[int],
    columns: BatchColumns,
    states: ColumnStates,
    positions: npt.NDArray[np.intp] | None,
    transitions: list[SeriesTransition],
) -> tuple[ColumnStates, Bools]:
    """:meth:`SeriesState.advance` for every selected layer at once, one step row at a time (see there). Returns the
    states after and which selected layers a sample advanced."""
    arrays = states._arrays() if positions is None else tuple(array[positions] for array in states._arrays())
    seen, status, last, streak, clear, last_value = arrays
    names, selected = match.names, match.positions
    accepted_any = np.zeros(len(names), dtype=bool)
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
        seen = seen | accepted
        accepted_any |= accepted
    # Same order as the per-sample walk: by series, then by step.
    moves.sort(key=lambda move: move[0])
    for series, row, old, new, value in moves:
        sample = StepSample(columns.steps[row], columns.times[row], value)
        transitions.append(SeriesTransition(rule.name, names[series], rank, STATUSES[old], STATUSES[new], sample))
    if positions is None:
        return ColumnStates(rule.name, states.layers, seen, status, last, streak, clear, last_value), accepted_any
    merged = [array.copy() for array in states._arrays()]
    for whole_array, part in zip(merged, (seen, status, last, streak, clear, last_value), strict=True):
        whole_array[positions] = part
    return ColumnStates(rule.name, states.layers, *merged), accepted_any
