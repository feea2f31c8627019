"""Episodes in memory while one batch's events apply to them: what the ingest path writes back in bulk.

:func:`apply_event` is the in-memory counterpart of opening, firing, resolving or dropping an episode row; the
repository (:mod:`~quantwatch.service.alerts.repository`) reads the rows into :class:`Episode` and writes back what a
batch touched with a few bulk statements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from quantwatch.service.alerts.evaluator import EpisodeEvent, SeriesTransition
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.webhooks import Notification

__all__ = [
    "EPISODE_CHANGES",
    "EPISODE_COLUMNS",
    "EPISODE_READ",
    "Episode",
    "EpisodeBatch",
    "EpisodeFields",
    "apply_event",
    "json_value",
]

EPISODE_COLUMNS = (
    "rule_id",
    "rule_name",
    "run",
    "layer",
    "state",
    "severity",
    "ranks",
    "step",
    "value",
    "value_text",
    "pending_step",
    "pending_at",
    "firing_step",
    "firing_at",
    "resolved_step",
    "resolved_at",
    "labels",
    "annotations",
)
# What a later batch may change on an episode: everything but its identity and when it opened.
_EPISODE_FIXED = frozenset({"rule_id", "rule_name", "run", "layer", "severity", "pending_step", "pending_at"})
EPISODE_CHANGES = tuple(name for name in EPISODE_COLUMNS if name not in _EPISODE_FIXED)
_LABELS = ("labels", "annotations")
_RANKS_ONLY = ("ranks",)
EPISODE_READ = tuple(name for name in EPISODE_COLUMNS if name not in _LABELS)
"""What the ingest path reads of an open episode: not its labels and annotations, which only a notification
changes, and then from the notification alone (a rank joining a firing episode, the commonest change, leaves them
as they are: reading and writing back two JSON objects per episode was most of that change's cost)."""


def json_value(value: float) -> tuple[float | None, str | None]:
    """A float as (number, text) columns: finite values as numbers, non-finite as ``"nan"``/``"inf"``/``"-inf"``."""
    if math.isfinite(value):
        return value, None
    if math.isnan(value):
        return None, "nan"
    return None, "inf" if value > 0 else "-inf"


class EpisodeFields(Protocol):
    """What a notification reads from an episode, as a row or in memory."""

    run: str
    layer: str
    ranks: list[int]
    step: int
    value: float | None
    value_text: str | None
    firing_at: float | None
    resolved_at: float | None


@dataclass(eq=False)
class Episode:
    """An episode row in memory while a batch's events apply to it; written back in bulk (``id`` once written)."""

    id: int | None
    rule_id: int
    rule_name: str
    run: str
    layer: str
    state: str
    severity: str
    ranks: list[int]
    step: int
    value: float | None
    value_text: str | None
    pending_step: int | None = None
    pending_at: float | None = None
    firing_step: int | None = None
    firing_at: float | None = None
    resolved_step: int | None = None
    resolved_at: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    notified: Notification | None = None  # the latest notification: the row's labels and annotations come from it
    fresh: bool = False  # opened by this batch: inserted (unless dropped) rather than updated
    touched: bool = False
    cancelled: bool = False

    def written_id(self) -> int:
        """The id of the written row (raises before the episode was written)."""
        if self.id is None:
            raise RuntimeError(f"episode of {self.rule_name!r} on {self.layer!r} has not been written")
        return self.id

    def insert_values(self) -> dict[str, Any]:
        """The row of a new episode."""
        self._label()
        return {name: getattr(self, name) for name in EPISODE_COLUMNS}

    def update_values(self) -> dict[str, Any]:
        """What a batch changed on an existing episode, keyed ``b_id`` plus the changed columns: every column a
        batch may change when it notified (it fired or resolved), else only its ``ranks`` (a rank joined it: every
        other change of an existing episode notifies, and a dropped one is deleted)."""
        self._label()
        names = EPISODE_CHANGES if self.notified is not None else _RANKS_ONLY
        return {"b_id": self.id, **{name: getattr(self, name) for name in names}}

    def _label(self) -> None:
        # Rendered once per written row rather than once per notification: a flapping batch notifies hundreds.
        if self.notified is not None:
            self.labels = self.notified.labels()
            self.annotations = self.notified.annotations()


@dataclass
class EpisodeBatch:
    """The episodes a batch touched (in order), each group's (episode id before, open episode after), notifications."""

    touched: list[Episode] = field(default_factory=list)
    groups: dict[tuple[int, str], tuple[int | None, Episode | None]] = field(default_factory=dict)
    notifications: list[tuple[Episode, Notification]] = field(default_factory=list)

    def touch(self, episode: Episode) -> None:
        """Mark ``episode`` to be written back."""
        if not episode.touched:
            episode.touched = True
            self.touched.append(episode)

    def changes_firing(self) -> bool:
        """Whether the batch changes its run's firing episodes: one fired, resolved, or fires on more ranks (a
        pending episode that opened, grew or was dropped is not among them)."""
        return any(episode.state != "pending" and not episode.cancelled for episode in self.touched)

    def notify(self, episode: Episode, notification: Notification) -> None:
        """Queue ``notification`` (its ``episode_id`` is set once the episode is written)."""
        episode.notified = notification
        self.notifications.append((episode, notification))


Notify = Callable[[Episode, Rule, str], Notification]
"""Builds the notification of an episode for a rule in a status (``firing`` or ``resolved``)."""


def apply_event(
    batch: EpisodeBatch,
    event: EpisodeEvent,
    episode: Episode | None,
    rule_id: int,
    rule: Rule,
    run: str,
    layer: str,
    move: SeriesTransition,
    active: set[int],
    notification: Notify,
) -> Episode | None:
    """One episode event in memory (the bulk counterpart of opening, firing, resolving or dropping a row)."""
    sample = move.sample
    value, value_text = json_value(sample.value)
    if event.kind == "open":
        episode = Episode(
            id=None,
            rule_id=rule_id,
            rule_name=rule.name,
            run=run,
            layer=layer,
            state=str(event.state),
            severity=rule.severity,
            ranks=sorted(active),
            step=sample.step,
            value=value,
            value_text=value_text,
            pending_step=sample.step,
            pending_at=sample.time,
            fresh=True,
        )
        batch.touch(episode)
        if event.state == "firing":
            episode.firing_step, episode.firing_at = sample.step, sample.time
            batch.notify(episode, notification(episode, rule, "firing"))
        return episode
    if episode is None:
        return None
    if event.kind == "cancel":
        batch.touch(episode)
        episode.cancelled = True
        return None
    batch.touch(episode)
    episode.step, episode.value, episode.value_text = sample.step, value, value_text
    if event.kind == "fire":
        episode.state = "firing"
        episode.ranks = sorted(set(episode.ranks) | active)
        episode.firing_step, episode.firing_at = sample.step, sample.time
        batch.notify(episode, notification(episode, rule, "firing"))
        return episode
    episode.state = "resolved"
    episode.resolved_step, episode.resolved_at = sample.step, sample.time
    batch.notify(episode, notification(episode, rule, "resolved"))
    return episode
