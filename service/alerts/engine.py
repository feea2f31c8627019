"""Alert evaluation on ingest: the ingest observer that runs the state machine inside the ingest transaction.

For one batch of one (run, rank), inside the transaction that stores its points:

1. lock the (run, rank) cursor row (``SELECT … FOR UPDATE``), so replicas ingesting that rank take turns;
2. read the rank's series states, run :func:`~quantwatch.service.alerts.evaluator.evaluate_columns` (numpy over the
   batch's layers), upsert the states in one statement;
3. for the (rule, layer) groups whose series changed status: lock their group rows in sorted order (no deadlocks
   between replicas), re-read every rank's status (committed by whoever held the locks before), advance the
   episodes in memory, then write episodes, group pointers and outbox rows with a few bulk statements per batch
   (not a dozen per series: a flapping run moves hundreds of series per batch).

Everything commits with the points, or not at all; the delivery worker only ever sees committed notifications.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
from sqlalchemy import Connection, Table, bindparam, delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from quantwatch.service.alerts.evaluator import (
    BatchColumns,
    EpisodeEvent,
    MetricColumn,
    SeriesKey,
    SeriesState,
    SeriesStatus,
    SeriesTransition,
    StepInput,
    advance_episode,
    evaluate_columns,
)
from quantwatch.service.alerts.rules import ReceiverSpec, Rule
from quantwatch.service.alerts.tables import (
    AlertCursorRow,
    AlertGroupRow,
    DeliveryRow,
    EpisodeRow,
    ReceiverRow,
    RuleRow,
    SeriesStateRow,
)
from quantwatch.service.alerts.webhooks import Notification, alertmanager_body, webhook_body

if TYPE_CHECKING:
    from quantwatch.service.batch import IngestBatch
    from quantwatch.service.models import Run

LEASE_SECONDS = 120.0
"""How long a delivery worker owns an outbox row it is sending; after that any worker may retry it."""

__all__ = [
    "LEASE_SECONDS",
    "AlertEngine",
    "SeriesSnapshot",
    "batch_columns",
    "insert_ignore",
    "json_value",
    "receiver_spec",
]

# Core tables: the ingest path writes whole batches of rows without the ORM's per-object bookkeeping.
_CURSORS = cast(Table, AlertCursorRow.__table__)
_SERIES = cast(Table, SeriesStateRow.__table__)
_GROUPS = cast(Table, AlertGroupRow.__table__)
_EPISODES = cast(Table, EpisodeRow.__table__)
_DELIVERIES = cast(Table, DeliveryRow.__table__)
_EPISODE_COLUMNS = (
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
_EPISODE_CHANGES = tuple(name for name in _EPISODE_COLUMNS if name not in _EPISODE_FIXED)
_STATUS = {status.value: status for status in SeriesStatus}
_EPISODE_UPDATE = update(_EPISODES).where(_EPISODES.c.id == bindparam("b_id"))
_GROUP_UPDATE = update(_GROUPS).where(
    _GROUPS.c.rule_id == bindparam("b_rule_id"), _GROUPS.c.layer == bindparam("b_layer")
)


def json_value(value: float) -> tuple[float | None, str | None]:
    """A float as (number, text) columns: finite values as numbers, non-finite as ``"nan"``/``"inf"``/``"-inf"``."""
    if math.isfinite(value):
        return value, None
    if math.isnan(value):
        return None, "nan"
    return None, "inf" if value > 0 else "-inf"


def insert_ignore(session: Session, table: Any, rows: list[dict[str, Any]], keys: Sequence[str]) -> None:
    """``INSERT … ON CONFLICT (keys) DO NOTHING`` on SQLite and PostgreSQL (a Core statement, one round of rows)."""
    if not rows:
        return
    conn = session.connection()
    dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    conn.execute(dialect_insert(table).on_conflict_do_nothing(index_elements=list(keys)), rows)


def _state_upsert(dialect: str) -> Any:
    statement = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(_SERIES)
    return statement.on_conflict_do_update(
        index_elements=["rule_id", "run", "rank", "layer"],
        set_={
            name: statement.excluded[name] for name in ("status", "last_step", "streak", "clear_streak", "last_value")
        },
    )


# Built once per dialect: building and cache-keying the statement per batch costs more than running it.
_STATE_UPSERTS = {dialect: _state_upsert(dialect) for dialect in ("sqlite", "postgresql")}


def _upsert_states(session: Session, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    conn = session.connection()
    conn.execute(_STATE_UPSERTS[conn.dialect.name], rows)


def _read_episodes(conn: Connection, ids: list[int]) -> dict[int, _Episode]:
    if not ids:
        return {}
    columns = [_EPISODES.c[name] for name in _EPISODE_COLUMNS]
    return {
        int(row[0]): _Episode(int(row[0]), *row[1:])
        for row in conn.execute(select(_EPISODES.c.id, *columns).where(_EPISODES.c.id.in_(ids)))
    }


class _EpisodeFields(Protocol):
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
class _Episode:
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
        return {name: getattr(self, name) for name in _EPISODE_COLUMNS}

    def update_values(self) -> dict[str, Any]:
        """What a batch may change on an existing episode, keyed for :data:`_EPISODE_UPDATE`."""
        self._label()
        return {"b_id": self.id, **{name: getattr(self, name) for name in _EPISODE_CHANGES}}

    def _label(self) -> None:
        # Rendered once per written row rather than once per notification: a flapping batch notifies hundreds.
        if self.notified is not None:
            self.labels = self.notified.labels()
            self.annotations = self.notified.annotations()


@dataclass
class _EpisodeBatch:
    """The episodes a batch touched (in order), each group's (episode id before, open episode after), notifications."""

    touched: list[_Episode] = field(default_factory=list)
    groups: dict[tuple[int, str], tuple[int | None, _Episode | None]] = field(default_factory=dict)
    notifications: list[tuple[_Episode, Notification]] = field(default_factory=list)

    def touch(self, episode: _Episode) -> None:
        """Mark ``episode`` to be written back."""
        if not episode.touched:
            episode.touched = True
            self.touched.append(episode)

    def notify(self, episode: _Episode, notification: Notification) -> None:
        """Queue ``notification`` (its ``episode_id`` is set once the episode is written)."""
        episode.notified = notification
        self.notifications.append((episode, notification))


@dataclass(frozen=True)
class SeriesSnapshot:
    """One series' evaluator state, as read for Prometheus (see :meth:`AlertEngine.series_snapshot`)."""

    rule: str
    run: str
    rank: int
    layer: str
    series: str
    status: str
    streak: int
    last_step: int | None


@dataclass
class _RuleCache:
    by_id: dict[int, tuple[int, Rule]] = field(default_factory=dict)


class AlertEngine:
    """The alerting ingest observer: ``on_batch`` inside the ingest transaction, ``after_commit`` after it.

    Outbox rows are written already leased (``claimed_until``) to this process: after the commit, ``dispatch``
    hands their ids straight to the local delivery worker, so a notification leaves without a claim transaction
    (on SQLite that would queue behind ingest for the write lock). If the process dies first, the lease runs out and
    any replica's worker sends them. A row behind an undelivered earlier one of the same (episode, receiver) is
    left unleased for the worker's ordered claim instead, and ``wake`` nudges the worker. Without ``dispatch`` every
    row goes through the worker's claim.
    """

    def __init__(
        self,
        *,
        external_url: str,
        delivery_horizon_seconds: float,
        wake: Callable[[], None] = lambda: None,
        dispatch: Callable[[list[int]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.external_url = external_url
        self.delivery_horizon_seconds = delivery_horizon_seconds
        self._wake = wake
        self._dispatch = dispatch
        self._clock = clock
        self._rules = _RuleCache()
        self._rules_lock = threading.Lock()
        self._enqueued = threading.local()
        self._latest: dict[tuple[str, str, int, str], SeriesSnapshot] = {}
        self._latest_lock = threading.Lock()

    # -- rules -------------------------------------------------------------------------------------------------
    def active_rules(self, session: Session) -> list[tuple[int, Rule]]:
        """Enabled rules as (id, Rule), re-parsed only when their revision changed (one small query per batch)."""
        rows = session.execute(
            select(RuleRow.id, RuleRow.revision, RuleRow.definition).where(RuleRow.enabled.is_(True))
        ).all()
        with self._rules_lock:
            cache = self._rules.by_id
            fresh: dict[int, tuple[int, Rule]] = {}
            for rule_id, revision, definition in rows:
                cached = cache.get(rule_id)
                if cached is not None and cached[0] == revision:
                    fresh[rule_id] = cached
                else:
                    fresh[rule_id] = (revision, Rule.model_validate(definition))
            self._rules.by_id = fresh
        return [(rule_id, rule) for rule_id, (_, rule) in sorted(fresh.items())]

    # -- ingest observer ---------------------------------------------------------------------------------------
    def on_batch(self, session: Session, run_row: Run, batch: IngestBatch) -> None:
        """:class:`~quantwatch.service.batch.IngestObserver` hook: evaluate inside the ingest transaction."""
        now = self._clock()
        self._evaluate(session, batch.run, batch.rank, batch.layers, lambda metrics: batch_columns(batch, metrics, now))

    def after_commit(self, batch: IngestBatch) -> None:
        """:class:`~quantwatch.service.batch.IngestObserver` hook: publish the committed series states to
        :meth:`latest_series` and hand new outbox rows to the delivery worker."""
        staged: list[SeriesSnapshot] = getattr(self._enqueued, "staged", [])
        self._enqueued.staged = []
        if staged:
            with self._latest_lock:
                for snapshot in staged:
                    self._latest[(snapshot.rule, snapshot.run, snapshot.rank, snapshot.layer)] = snapshot
        self.send_enqueued()

    def send_enqueued(self) -> None:
        """After a commit: dispatch the leased outbox rows this thread wrote and wake the worker for the others."""
        leased, unleased = self.take_enqueued()
        if leased and self._dispatch is not None:
            self._dispatch(leased)
        if unleased:
            self._wake()

    def wake(self) -> None:
        """Wake the delivery worker (after a redelivery, say)."""
        self._wake()

    def evaluate(self, session: Session, run: str, rank: int, layers: Sequence[str], steps: Sequence[StepInput]) -> int:
        """Evaluate one batch given per step inside the caller's transaction; returns how many outbox rows it wrote."""
        return self._evaluate(
            session, run, rank, layers, lambda metrics: BatchColumns.from_steps(len(layers), steps, metrics)
        )

    def _evaluate(
        self,
        session: Session,
        run: str,
        rank: int,
        layers: Sequence[str],
        columns_of: Callable[[Iterable[str]], BatchColumns],
    ) -> int:
        self._enqueued.staged = []
        self.take_enqueued()
        rules = [(rule_id, rule) for rule_id, rule in self.active_rules(session) if rule.matches_run(run)]
        if not rules:
            return 0
        columns = columns_of({rule.metric for _, rule in rules if rule.metric is not None})
        if not columns.steps:
            return 0
        conn = session.connection()
        insert_ignore(session, _CURSORS, [{"run": run, "rank": rank}], ("run", "rank"))
        conn.execute(
            select(_CURSORS.c.run).where(_CURSORS.c.run == run, _CURSORS.c.rank == rank).with_for_update()
        ).all()
        ids = {rule.name: rule_id for rule_id, rule in rules}
        names = {rule_id: rule.name for rule_id, rule in rules}
        states: dict[SeriesKey, SeriesState] = {
            (names[rule_id], layer): SeriesState(_STATUS[status], last_step, streak, clear_streak, last_value)
            for rule_id, layer, status, last_step, streak, clear_streak, last_value in conn.execute(
                select(
                    _SERIES.c.rule_id,
                    _SERIES.c.layer,
                    _SERIES.c.status,
                    _SERIES.c.last_step,
                    _SERIES.c.streak,
                    _SERIES.c.clear_streak,
                    _SERIES.c.last_value,
                ).where(_SERIES.c.run == run, _SERIES.c.rank == rank, _SERIES.c.rule_id.in_(list(names)))
            )
        }
        changed, transitions = evaluate_columns([rule for _, rule in rules], run, rank, layers, columns, states)
        by_name = {rule.name: rule for _, rule in rules}
        self._enqueued.staged = [
            SeriesSnapshot(
                name, run, rank, layer, by_name[name].series, state.status.value, state.streak, state.last_step
            )
            for (name, layer), state in changed.items()
        ]
        _upsert_states(
            session,
            [
                {
                    "rule_id": ids[rule_name],
                    "run": run,
                    "rank": rank,
                    "layer": layer,
                    "status": state.status.value,
                    "last_step": state.last_step,
                    "streak": state.streak,
                    "clear_streak": state.clear_streak,
                    "last_value": state.last_value
                    if state.last_value is None or math.isfinite(state.last_value)
                    else None,
                }
                for (rule_name, layer), state in changed.items()
            ],
        )
        if not transitions:
            return 0
        by_group: dict[tuple[int, str], list[SeriesTransition]] = {}
        for transition in transitions:
            by_group.setdefault((ids[transition.rule], transition.layer), []).append(transition)
        return self._advance_groups(session, dict(rules), run, by_group)

    def _advance_groups(
        self,
        session: Session,
        rules: dict[int, Rule],
        run: str,
        by_group: dict[tuple[int, str], list[SeriesTransition]],
    ) -> int:
        """Episode events of every (rule, layer) that moved, with a handful of bulk statements for the whole batch."""
        conn = session.connection()
        keys = sorted(by_group)
        insert_ignore(
            session,
            _GROUPS,
            [{"rule_id": rule_id, "run": run, "layer": layer, "episode_id": None} for rule_id, layer in keys],
            ("rule_id", "run", "layer"),
        )
        layers_by_rule: dict[int, list[str]] = {}
        for rule_id, layer in keys:
            layers_by_rule.setdefault(rule_id, []).append(layer)
        opened: dict[tuple[int, str], int | None] = {}
        statuses: dict[tuple[int, str], dict[int, SeriesStatus]] = {key: {} for key in keys}
        for rule_id, layers in layers_by_rule.items():
            # Lock the groups in (rule, layer) order, the same order in every replica: no deadlocks between them.
            for layer, episode_id in conn.execute(
                select(_GROUPS.c.layer, _GROUPS.c.episode_id)
                .where(_GROUPS.c.rule_id == rule_id, _GROUPS.c.run == run, _GROUPS.c.layer.in_(layers))
                .order_by(_GROUPS.c.layer)
                .with_for_update()
            ):
                opened[(rule_id, layer)] = episode_id
            for rank, layer, status in conn.execute(
                select(_SERIES.c.rank, _SERIES.c.layer, _SERIES.c.status).where(
                    _SERIES.c.rule_id == rule_id, _SERIES.c.run == run, _SERIES.c.layer.in_(layers)
                )
            ):
                statuses[(rule_id, layer)][rank] = _STATUS[status]
        episodes = _read_episodes(conn, [episode_id for episode_id in opened.values() if episode_id is not None])
        batch = _EpisodeBatch()
        for key in keys:
            rule_id, layer = key
            episode_id = opened[key]
            episode = episodes.get(episode_id) if episode_id is not None else None
            group_statuses = statuses[key]
            for move in by_group[key]:
                group_statuses[move.rank] = move.after
                active = {rank for rank, status in group_statuses.items() if status is not SeriesStatus.INACTIVE}
                open_state = episode.state if episode is not None and episode.state != "resolved" else None
                for event in advance_episode(open_state, group_statuses.values()):  # type: ignore[arg-type]
                    episode = self._apply_event(
                        batch, event, episode, rule_id, rules[rule_id], run, layer, move, active
                    )
                if episode is not None and episode.state != "resolved" and not active.issubset(episode.ranks):
                    batch.touch(episode)
                    episode.ranks = sorted(set(episode.ranks) | active)
            still_open = episode if episode is not None and episode.state != "resolved" else None
            batch.groups[key] = (episode_id, still_open)
        return self._write_episodes(session, rules, run, batch)

    def _apply_event(
        self,
        batch: _EpisodeBatch,
        event: EpisodeEvent,
        episode: _Episode | None,
        rule_id: int,
        rule: Rule,
        run: str,
        layer: str,
        move: SeriesTransition,
        active: set[int],
    ) -> _Episode | None:
        """One episode event in memory (the bulk counterpart of opening, firing, resolving or dropping a row)."""
        sample = move.sample
        value, value_text = json_value(sample.value)
        if event.kind == "open":
            episode = _Episode(
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
                batch.notify(episode, self._notification(episode, rule, "firing", 0))
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
            batch.notify(episode, self._notification(episode, rule, "firing", 0))
            return episode
        episode.state = "resolved"
        episode.resolved_step, episode.resolved_at = sample.step, sample.time
        batch.notify(episode, self._notification(episode, rule, "resolved", 0))
        return episode

    def _write_episodes(self, session: Session, rules: dict[int, Rule], run: str, batch: _EpisodeBatch) -> int:
        """Write what :meth:`_advance_groups` decided: episodes, group pointers, then the outbox rows."""
        conn = session.connection()
        existing = [episode for episode in batch.touched if not episode.fresh]
        # Ended and dropped episodes first: a group's new open episode must not meet its old one in the unique index.
        kept = [episode for episode in existing if not episode.cancelled]
        if kept:
            conn.execute(_EPISODE_UPDATE, [episode.update_values() for episode in kept])
        dropped = [episode.id for episode in existing if episode.cancelled]
        if dropped:
            conn.execute(delete(_EPISODES).where(_EPISODES.c.id.in_(dropped)))
        new = [episode for episode in batch.touched if episode.fresh and not episode.cancelled]
        if new:
            # Matched back by (rule, layer, pending step), unique among one rank's new episodes: an ordered RETURNING
            # would make SQLite insert row by row.
            by_start = {(episode.rule_id, episode.layer, episode.pending_step): episode for episode in new}
            returned = conn.execute(
                insert(_EPISODES).returning(
                    _EPISODES.c.id, _EPISODES.c.rule_id, _EPISODES.c.layer, _EPISODES.c.pending_step
                ),
                [episode.insert_values() for episode in new],
            )
            for episode_id, rule_id, layer, pending_step in returned:
                by_start[(rule_id, layer, pending_step)].id = int(episode_id)
        moved = [
            {"b_rule_id": rule_id, "b_layer": layer, "episode_id": episode.id if episode is not None else None}
            for (rule_id, layer), (before, episode) in batch.groups.items()
            if (episode.id if episode is not None else None) != before
        ]
        if moved:
            conn.execute(_GROUP_UPDATE.where(_GROUPS.c.run == run), moved)
        if not batch.notifications:
            return 0
        return self._write_outbox(session, rules, batch)

    def _write_outbox(self, session: Session, rules: dict[int, Rule], batch: _EpisodeBatch) -> int:
        conn = session.connection()
        now = self._clock()
        receivers = {
            rule_id: _receivers_for(session, rules[rule_id])
            for rule_id in sorted({episode.rule_id for episode, _ in batch.notifications})
        }
        if not any(receivers.values()):
            return 0
        known = {episode.written_id() for episode, _ in batch.notifications if not episode.fresh}
        waiting: set[tuple[int, int]] = set()
        if known:
            waiting = {
                (int(episode_id), int(receiver_id))
                for episode_id, receiver_id in conn.execute(
                    select(_DELIVERIES.c.episode_id, _DELIVERIES.c.receiver_id).where(
                        _DELIVERIES.c.episode_id.in_(sorted(known)), _DELIVERIES.c.status == "pending"
                    )
                )
            }
        rows: list[dict[str, Any]] = []
        for episode, notification in batch.notifications:
            episode_id = episode.written_id()
            sent = replace(notification, episode_id=episode_id)
            for receiver in receivers[episode.rule_id]:
                if sent.status == "resolved" and not receiver.send_resolved:
                    continue
                # A row behind a pending one of the same (episode, receiver) waits for the worker's ordered claim.
                rows.append(self._delivery_values(sent, receiver, now, (episode_id, receiver.id) in waiting))
                waiting.add((episode_id, receiver.id))
        if not rows:
            return 0
        # Matched back by webhook id (unique): an ordered RETURNING would make SQLite insert row by row.
        ids: dict[str, int] = dict(
            conn.execute(insert(_DELIVERIES).returning(_DELIVERIES.c.webhook_id, _DELIVERIES.c.id), rows).all()
        )
        self._record_enqueued([(ids[row["webhook_id"]], row["claimed_until"]) for row in rows])
        return len(rows)

    def notification(self, episode: EpisodeRow, rule: Rule, status: str) -> Notification:
        """The notification for ``episode`` in ``status`` (``firing`` or ``resolved``)."""
        return self._notification(episode, rule, status, episode.id)

    def _notification(self, episode: _EpisodeFields, rule: Rule, status: str, episode_id: int) -> Notification:
        """The notification of ``episode`` in ``status``."""
        value = episode.value if episode.value is not None else float(episode.value_text or "nan")
        return Notification(
            status="resolved" if status == "resolved" else "firing",
            rule=rule,
            run=episode.run,
            layer=episode.layer,
            ranks=list(episode.ranks),
            step=episode.step,
            value=value,
            starts_at=episode.firing_at if episode.firing_at is not None else self._clock(),
            ends_at=episode.resolved_at if status == "resolved" else None,
            episode_id=episode_id,
            external_url=self.external_url,
        )

    def notify(self, session: Session, episode: EpisodeRow, rule: Rule, status: str) -> int:
        """Write the outbox rows of ``episode``'s ``status`` notification for the rule's receivers."""
        notification = self.notification(episode, rule, status)
        episode.labels = notification.labels()
        episode.annotations = notification.annotations()
        receivers = _receivers_for(session, rule)
        now = self._clock()
        waiting = set(
            session.scalars(
                select(DeliveryRow.receiver_id).where(
                    DeliveryRow.episode_id == episode.id, DeliveryRow.status == "pending"
                )
            )
        )
        rows = [
            DeliveryRow(**self._delivery_values(notification, receiver, now, receiver.id in waiting))
            for receiver in receivers
            if status != "resolved" or receiver.send_resolved
        ]
        session.add_all(rows)
        session.flush()
        self._record_enqueued([(row.id, row.claimed_until) for row in rows])
        return len(rows)

    def _delivery_values(
        self, notification: Notification, receiver: ReceiverRow, now: float, waiting: bool
    ) -> dict[str, Any]:
        """The outbox row of ``notification`` for ``receiver``; leased to this process unless ``waiting``."""
        if receiver.type == "alertmanager":
            body: Any = alertmanager_body(notification, now)
        else:
            body = webhook_body(notification, receiver.name)
        return {
            "episode_id": notification.episode_id,
            "receiver_id": receiver.id,
            "event": notification.status,
            "webhook_id": f"msg_{uuid.uuid4().hex}",
            "body": json.dumps(body, separators=(",", ":"), allow_nan=False),
            "status": "pending",
            "attempts": 0,
            "created_at": now,
            "next_attempt_at": now,
            "expires_at": now + self.delivery_horizon_seconds,
            "claimed_until": None if self._dispatch is None or waiting else now + LEASE_SECONDS,
        }

    def _record_enqueued(self, rows: Iterable[tuple[int, float | None]]) -> None:
        """Remember the ids of outbox rows this thread wrote, by (id, claimed_until), for :meth:`take_enqueued`."""
        leased: list[int] = getattr(self._enqueued, "leased", [])
        unleased: list[int] = getattr(self._enqueued, "unleased", [])
        for row_id, claimed_until in rows:
            (leased if claimed_until is not None else unleased).append(row_id)
        self._enqueued.leased, self._enqueued.unleased = leased, unleased

    def take_enqueued(self) -> tuple[list[int], list[int]]:
        """Ids of the (leased, unleased) outbox rows this thread wrote since the last call (then forgotten)."""
        leased: list[int] = getattr(self._enqueued, "leased", [])
        unleased: list[int] = getattr(self._enqueued, "unleased", [])
        self._enqueued.leased, self._enqueued.unleased = [], []
        return leased, unleased

    # -- reads for Prometheus and the API ----------------------------------------------------------------------
    def latest_series(self) -> list[SeriesSnapshot]:
        """Streak and status of every series this process evaluated since it started (in memory, no database).

        For the Prometheus exposition's scrape path: cheap, and current for the series this replica ingests.
        :meth:`series_snapshot` reads the authoritative state of all replicas from the database.
        """
        with self._latest_lock:
            return list(self._latest.values())

    def series_snapshot(self, session: Session, runs: Iterable[str] | None = None) -> list[SeriesSnapshot]:
        """Every series' streak and status (optionally for some runs) from the database, whichever replica wrote it."""
        query = select(SeriesStateRow, RuleRow.name, RuleRow.definition).join(
            RuleRow, RuleRow.id == SeriesStateRow.rule_id
        )
        if runs is not None:
            query = query.where(SeriesStateRow.run.in_(list(runs)))
        snapshots = []
        for row, name, definition in session.execute(query):
            series = definition.get("metric") or definition.get("scalar") or ""
            snapshots.append(
                SeriesSnapshot(name, row.run, row.rank, row.layer, str(series), row.status, row.streak, row.last_step)
            )
        return snapshots


def batch_columns(batch: IngestBatch, metrics: Iterable[str], now: float) -> BatchColumns:
    """The evaluator's view of ``metrics`` in a decoded batch: float64 matrices, not-measured values masked out, a
    missing time replaced by ``now``."""
    rows, width = len(batch.steps), len(batch.layers)
    columns: dict[str, MetricColumn] = {}
    for name in metrics:
        if not any(name in item.metrics for item in batch.steps):
            continue  # no series of this metric moves: leave the rule nothing to walk
        values = np.full((rows, width), np.nan)
        measured = np.zeros((rows, width), dtype=bool)
        for row, item in enumerate(batch.steps):
            reported = item.metrics.get(name)
            if reported is None:
                continue
            values[row] = reported
            missing = item.missing.get(name)
            measured[row] = True if missing is None else ~missing
        columns[name] = MetricColumn(values, measured)
    return BatchColumns(
        tuple(item.step for item in batch.steps),
        tuple(item.time if item.time is not None else now for item in batch.steps),
        columns,
        tuple(item.scalars for item in batch.steps),
    )


def _receivers_for(session: Session, rule: Rule) -> list[ReceiverRow]:
    query = select(ReceiverRow).where(ReceiverRow.enabled.is_(True))
    if rule.receivers:
        query = query.where(ReceiverRow.name.in_(rule.receivers))
    return list(session.scalars(query.order_by(ReceiverRow.id)))


def receiver_spec(row: ReceiverRow) -> ReceiverSpec:
    """The validated receiver of a row (with its secrets, for signing)."""
    return ReceiverSpec.model_validate(
        {
            "name": row.name,
            "type": row.type,
            "url": row.url,
            "secrets": list(row.secrets),
            "headers": dict(row.headers),
            "timeout_seconds": row.timeout_seconds,
            "send_resolved": row.send_resolved,
            "enabled": row.enabled,
        }
    )
