"""Alert evaluation on ingest: the ingest observer that runs the state machine inside the ingest transaction.

For one batch of one (run, rank), inside the transaction that stores its points:

1. lock the (run, rank) cursor row (``SELECT … FOR UPDATE``), so replicas ingesting that rank take turns;
2. read the rank's series states, run :func:`~quantwatch.service.alerts.evaluator.evaluate_batch`, upsert the states;
3. for each (rule, layer) whose series changed status, in sorted order (no deadlocks between replicas), lock the
   group row, re-read every rank's status (committed by whoever held the lock before), advance the episode and write
   the episode row and its outbox rows.

Everything commits with the points, or not at all; the delivery worker only ever sees committed notifications.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from quantwatch.service.alerts.evaluator import (
    EpisodeEvent,
    SeriesKey,
    SeriesState,
    SeriesStatus,
    SeriesTransition,
    StepInput,
    advance_episode,
    evaluate_batch,
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
    "insert_ignore",
    "json_value",
    "receiver_spec",
    "step_inputs",
]


def json_value(value: float) -> tuple[float | None, str | None]:
    """A float as (number, text) columns: finite values as numbers, non-finite as ``"nan"``/``"inf"``/``"-inf"``."""
    if math.isfinite(value):
        return value, None
    if math.isnan(value):
        return None, "nan"
    return None, "inf" if value > 0 else "-inf"


def insert_ignore(session: Session, table: Any, rows: list[dict[str, Any]], keys: Sequence[str]) -> None:
    """``INSERT … ON CONFLICT (keys) DO NOTHING`` on SQLite and PostgreSQL."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    session.execute(insert(table).on_conflict_do_nothing(index_elements=list(keys)), rows)


def _upsert_states(session: Session, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(SeriesStateRow)
    statement = statement.on_conflict_do_update(
        index_elements=["rule_id", "run", "rank", "layer"],
        set_={
            name: statement.excluded[name] for name in ("status", "last_step", "streak", "clear_streak", "last_value")
        },
    )
    session.execute(statement, rows)


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
        self.evaluate(session, batch.run, batch.rank, batch.layers, step_inputs(batch, self._clock()))

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
        """Evaluate one batch inside the caller's transaction; returns how many outbox rows it wrote."""
        self._enqueued.staged = []
        self.take_enqueued()
        rules = [(rule_id, rule) for rule_id, rule in self.active_rules(session) if rule.matches_run(run)]
        if not rules or not steps:
            return 0
        insert_ignore(session, AlertCursorRow, [{"run": run, "rank": rank}], ("run", "rank"))
        session.execute(
            select(AlertCursorRow.run).where(AlertCursorRow.run == run, AlertCursorRow.rank == rank).with_for_update()
        ).all()
        ids = {rule.name: rule_id for rule_id, rule in rules}
        names = {rule_id: rule.name for rule_id, rule in rules}
        states: dict[SeriesKey, SeriesState] = {}
        for row in session.scalars(
            select(SeriesStateRow).where(
                SeriesStateRow.run == run, SeriesStateRow.rank == rank, SeriesStateRow.rule_id.in_(list(names))
            )
        ):
            states[(names[row.rule_id], row.layer)] = SeriesState(
                SeriesStatus(row.status), row.last_step, row.streak, row.clear_streak, row.last_value
            )
        changed, transitions = evaluate_batch([rule for _, rule in rules], run, rank, layers, steps, states)
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
        rule_by_id = dict(rules)
        written = 0
        for rule_id, layer in sorted(by_group):
            written += self._advance_group(
                session, rule_id, rule_by_id[rule_id], run, layer, by_group[(rule_id, layer)]
            )
        return written

    def _advance_group(
        self, session: Session, rule_id: int, rule: Rule, run: str, layer: str, moves: list[SeriesTransition]
    ) -> int:
        insert_ignore(
            session,
            AlertGroupRow,
            [{"rule_id": rule_id, "run": run, "layer": layer, "episode_id": None}],
            ("rule_id", "run", "layer"),
        )
        group = session.scalars(
            select(AlertGroupRow)
            .where(AlertGroupRow.rule_id == rule_id, AlertGroupRow.run == run, AlertGroupRow.layer == layer)
            .with_for_update()
            .execution_options(populate_existing=True)
        ).one()
        statuses = {
            rank: SeriesStatus(status)
            for rank, status in session.execute(
                select(SeriesStateRow.rank, SeriesStateRow.status).where(
                    SeriesStateRow.rule_id == rule_id, SeriesStateRow.run == run, SeriesStateRow.layer == layer
                )
            )
        }
        episode = session.get(EpisodeRow, group.episode_id) if group.episode_id is not None else None
        written = 0
        for move in moves:
            statuses[move.rank] = move.after
            active = {rank for rank, status in statuses.items() if status is not SeriesStatus.INACTIVE}
            state = episode.state if episode is not None else None
            open_state = state if state in ("pending", "firing") else None
            for event in advance_episode(open_state, statuses.values()):  # type: ignore[arg-type]
                episode, count = self._apply(session, event, episode, rule_id, rule, run, layer, move, active)
                written += count
            if episode is not None and episode.state != "resolved" and not active.issubset(episode.ranks):
                episode.ranks = sorted(set(episode.ranks) | active)
        group.episode_id = episode.id if episode is not None and episode.state != "resolved" else None
        return written

    def _apply(
        self,
        session: Session,
        event: EpisodeEvent,
        episode: EpisodeRow | None,
        rule_id: int,
        rule: Rule,
        run: str,
        layer: str,
        move: SeriesTransition,
        active: set[int],
    ) -> tuple[EpisodeRow | None, int]:
        sample = move.sample
        value, value_text = json_value(sample.value)
        if event.kind == "open":
            episode = EpisodeRow(
                rule_id=rule_id,
                rule_name=rule.name,
                run=run,
                layer=layer,
                state=event.state,
                severity=rule.severity,
                ranks=sorted(active),
                step=sample.step,
                value=value,
                value_text=value_text,
                pending_step=sample.step,
                pending_at=sample.time,
                labels={},
                annotations={},
            )
            if event.state == "firing":
                episode.firing_step, episode.firing_at = sample.step, sample.time
            session.add(episode)
            session.flush()
            return episode, self.notify(session, episode, rule, "firing") if event.state == "firing" else 0
        if episode is None:
            return None, 0
        if event.kind == "cancel":
            session.delete(episode)
            session.flush()
            return None, 0
        episode.step, episode.value, episode.value_text = sample.step, value, value_text
        if event.kind == "fire":
            episode.state = "firing"
            episode.ranks = sorted(set(episode.ranks) | active)
            episode.firing_step, episode.firing_at = sample.step, sample.time
            return episode, self.notify(session, episode, rule, "firing")
        episode.state = "resolved"
        episode.resolved_step, episode.resolved_at = sample.step, sample.time
        session.flush()
        return episode, self.notify(session, episode, rule, "resolved")

    def notification(self, episode: EpisodeRow, rule: Rule, status: str) -> Notification:
        """The notification for ``episode`` in ``status`` (``firing`` or ``resolved``)."""
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
            episode_id=episode.id,
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
        rows = []
        for receiver in receivers:
            if status == "resolved" and not receiver.send_resolved:
                continue
            if receiver.type == "alertmanager":
                body: Any = alertmanager_body(notification, now)
            else:
                body = webhook_body(notification, receiver.name)
            rows.append(
                DeliveryRow(
                    episode_id=episode.id,
                    receiver_id=receiver.id,
                    event=status,
                    webhook_id=f"msg_{uuid.uuid4().hex}",
                    body=json.dumps(body, separators=(",", ":"), allow_nan=False),
                    status="pending",
                    attempts=0,
                    created_at=now,
                    next_attempt_at=now,
                    expires_at=now + self.delivery_horizon_seconds,
                    claimed_until=None if self._dispatch is None or receiver.id in waiting else now + LEASE_SECONDS,
                )
            )
        session.add_all(rows)
        session.flush()
        leased: list[int] = getattr(self._enqueued, "leased", [])
        unleased: list[int] = getattr(self._enqueued, "unleased", [])
        for row in rows:
            (leased if row.claimed_until is not None else unleased).append(row.id)
        self._enqueued.leased, self._enqueued.unleased = leased, unleased
        return len(rows)

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


def step_inputs(batch: IngestBatch, now: float) -> list[StepInput]:
    """The evaluator's view of a decoded batch: not-measured values become ``None``, a missing time becomes ``now``."""
    steps = []
    for item in batch.steps:
        metrics: dict[str, list[float | None]] = {}
        for name, values in item.metrics.items():
            listed: list[float | None] = list(values.tolist())
            missing = item.missing.get(name)
            if missing is not None:
                listed = [None if gap else value for value, gap in zip(listed, missing.tolist(), strict=True)]
            metrics[name] = listed
        steps.append(StepInput(item.step, item.time if item.time is not None else now, metrics, dict(item.scalars)))
    return steps


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
