"""Alert series as the exposition reads them: one (rule, run, layer) streak and state, and where they come from."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from quantwatch.service.alerts.columns import STATUSES, ColumnStates, RuleStates

__all__ = [
    "DELIVERY_STATUSES",
    "EXPORTED_ALERT_STATES",
    "STATE_RANK",
    "AlertEngineLike",
    "AlertSeries",
    "AlertSeriesSource",
    "DeliveryCounts",
    "SeriesSnapshotLike",
    "StoredSeries",
    "alert_series_source",
    "severity_order",
]


@dataclass(frozen=True)
class AlertSeries:
    """The alert state of one (rule, run, layer) series, as the alert evaluator keeps it.

    ``layer`` is empty for rules on run scalars. ``state`` is one of inactive, pending, firing, resolved.
    """

    rule: str
    run: str
    layer: str
    streak_steps: int
    state: str


class AlertSeriesSource(Protocol):
    """Anything that lists the current alert series (the alert evaluator's store)."""

    def __call__(self) -> Iterable[AlertSeries]:
        """Return the series whose streak is non-zero or whose state is pending or firing."""
        ...


EXPORTED_ALERT_STATES = ("pending", "firing")
STATE_RANK = {"inactive": 0, "resolved": 0, "pending": 1, "firing": 2}
DELIVERY_STATUSES = ("pending", "delivered", "failed", "cancelled")

DeliveryCounts = Callable[[], Mapping[str, int]]
"""Number of outbox deliveries per status (pending, delivered, failed, cancelled)."""


class SeriesSnapshotLike(Protocol):
    """One stored series of one rank, as the restore reads it at start (:class:`StoredSeries`)."""

    @property
    def rule(self) -> str:
        """Rule name."""

    @property
    def run(self) -> str:
        """Run name."""

    @property
    def rank(self) -> int:
        """Rank of the series."""

    @property
    def layer(self) -> str:
        """Layer ('' for scalar rules)."""

    @property
    def status(self) -> str:
        """inactive, pending or firing."""

    @property
    def streak(self) -> int:
        """Consecutive breaching reported steps."""


class AlertEngineLike(Protocol):
    """The alert evaluator, as far as the exposition reads it."""

    def latest_states(self) -> Sequence[tuple[str, int, str, RuleStates]]:
        """(run, rank, rule name, that rule's states) of every (run, rank, rule) this process evaluated."""
        ...


@dataclass(frozen=True)
class StoredSeries:
    """One series' state as the database held it when the collector started (a :class:`SeriesSnapshotLike`)."""

    rule: str
    run: str
    rank: int
    layer: str
    status: str
    streak: int


def severity_order(state: str, streak_steps: int, layer: str) -> tuple[int, int, str]:
    """Sort key of the series exported first under the cap: firing, then pending, then the longest streaks."""
    return -STATE_RANK.get(state, 0), -streak_steps, layer


def _no_series() -> Sequence[SeriesSnapshotLike]:
    return ()


# By a series' stored status code (its index in STATUSES): its severity, and whether it is exported whatever its streak.
_SEVERITY = np.array([STATE_RANK[status.value] for status in STATUSES], dtype=np.int8)
_ALWAYS = np.array([status.value in EXPORTED_ALERT_STATES for status in STATUSES], dtype=bool)
_STATE_OF = {STATE_RANK[state]: state for state in ("inactive", *EXPORTED_ALERT_STATES)}


def alert_series_source(
    engine: AlertEngineLike, restored: Callable[[], Sequence[SeriesSnapshotLike]] = _no_series
) -> AlertSeriesSource:
    """Alert series of the evaluator's in-memory state, one per (rule, run, layer) across ranks.

    The streak exported is the longest of the ranks and the state the most severe, matching the evaluator's
    episodes, which are per (rule, run, layer) however many ranks breach; a series counts when its streak is non-zero
    or it is pending or firing. ``restored`` gives the series read from the database at start (see :mod:`.restore`):
    each counts until this process evaluates the same (rule, run, rank, layer) itself, whose state is then newer.
    The ranks of a (rule, run) whose states share their layers (every rank of a data-parallel job) are combined as
    arrays, one entry per layer: a scrape's cost grows with (run, rank, rule)s, not with series.
    """

    def source() -> list[AlertSeries]:
        live = engine.latest_states()
        columns: dict[tuple[str, str, tuple[str, ...]], list[ColumnStates]] = {}
        merged: dict[tuple[str, str, str], tuple[int, int]] = {}
        for run, _, rule, states in live:
            if isinstance(states, ColumnStates):
                columns.setdefault((rule, run, states.layers), []).append(states)
            else:  # a scalar rule's one series
                for (rule, layer), state in states.items():
                    _merge(merged, (rule, run, layer), state.status.value, state.streak)
        for (rule, run, layers), ranks in columns.items():
            for layer, streak, severity in _combined(layers, ranks):
                _merge_severity(merged, (rule, run, layer), severity, streak)
        stored = restored()
        if stored:
            evaluated = {(run, rank, rule): states for run, rank, rule, states in live}
            for snap in stored:
                newer = evaluated.get((snap.run, snap.rank, snap.rule))
                if newer is None or (snap.rule, snap.layer) not in newer:
                    _merge(merged, (snap.rule, snap.run, snap.layer), snap.status, snap.streak)
        return [
            AlertSeries(rule, run, layer, streak, _STATE_OF[severity])
            for (rule, run, layer), (streak, severity) in merged.items()
        ]

    return source


def _combined(layers: tuple[str, ...], ranks: list[ColumnStates]) -> Iterator[tuple[str, int, int]]:
    """(layer, longest streak, highest severity) of the layers where some rank's series counts."""
    seen = np.stack([states.seen for states in ranks])
    status = np.stack([states.status for states in ranks])
    streak = np.stack([states.streak for states in ranks])
    counts = seen & ((streak > 0) | _ALWAYS[status])
    longest = np.where(counts, streak, 0).max(axis=0)
    severity = np.where(counts, _SEVERITY[status], 0).max(axis=0)
    for position in np.flatnonzero(counts.any(axis=0)).tolist():
        yield layers[position], int(longest[position]), int(severity[position])


def _merge(
    merged: dict[tuple[str, str, str], tuple[int, int]], key: tuple[str, str, str], status: str, streak: int
) -> None:
    """Count one rank's series of ``key`` (when its streak is non-zero or it is pending or firing)."""
    if streak > 0 or status in EXPORTED_ALERT_STATES:
        _merge_severity(merged, key, STATE_RANK.get(status, 0), streak)


def _merge_severity(
    merged: dict[tuple[str, str, str], tuple[int, int]], key: tuple[str, str, str], severity: int, streak: int
) -> None:
    """Keep ``key``'s longest streak and highest severity (0 inactive, 1 pending, 2 firing) of those counted."""
    longest, worst = merged.get(key, (0, 0))
    merged[key] = (max(longest, streak), max(worst, severity))
