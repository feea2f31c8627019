"""Alert series as the exposition reads them: one (rule, run, layer) streak and state, and where they come from."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

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
    """One evaluator series as :meth:`AlertEngine.latest_series` returns it (per rank)."""

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

    def latest_series(self) -> Sequence[SeriesSnapshotLike]:
        """Streak and status of every series this process evaluated."""
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


def alert_series_source(
    engine: AlertEngineLike, restored: Callable[[], Sequence[SeriesSnapshotLike]] = _no_series
) -> AlertSeriesSource:
    """Alert series of the evaluator's in-memory state, one per (rule, run, layer) across ranks.

    The streak exported is the longest of the ranks and the state the most severe, matching the evaluator's
    episodes, which are per (rule, run, layer) however many ranks breach. ``restored`` gives the series read from
    the database at start (see :mod:`.restore`): each counts until this process evaluates the same (rule, run, rank,
    layer) itself, whose state is then newer.
    """

    def source() -> list[AlertSeries]:
        snapshots: Iterable[SeriesSnapshotLike] = engine.latest_series()
        stored = restored()
        if stored:
            latest = {(s.rule, s.run, s.rank, s.layer): s for s in stored}
            latest.update({(s.rule, s.run, s.rank, s.layer): s for s in snapshots})
            snapshots = latest.values()
        merged: dict[tuple[str, str, str], tuple[int, str]] = {}
        for snap in snapshots:
            if snap.streak <= 0 and snap.status not in EXPORTED_ALERT_STATES:
                continue
            key = (snap.rule, snap.run, snap.layer)
            streak, state = merged.get(key, (0, "inactive"))
            if STATE_RANK.get(snap.status, 0) > STATE_RANK.get(state, 0):
                state = snap.status
            merged[key] = (max(streak, snap.streak), state)
        return [AlertSeries(rule, run, layer, streak, state) for (rule, run, layer), (streak, state) in merged.items()]

    return source
