"""Alert evaluation on ingest: the ingest observer that runs the state machine inside the ingest transaction.

For one batch of one (run, rank), inside the transaction that stores its points:

1. take the (run, rank)'s turn: the ingest transaction holds the rank's write lock already (see
   :class:`~quantwatch.service.batch.IngestObserver`); :meth:`AlertEngine.evaluate`, called outside ingest, locks
   the (run, rank) cursor row (``SELECT … FOR UPDATE``), so replicas ingesting that rank take turns;
2. read the batch's head (:mod:`~quantwatch.service.alerts.head`: rule revisions, the rank's row tokens, the run's
   format count and firing tokens, in one statement), then the rank's series states (one row per rule; none when
   this process wrote the row last and its token is unchanged), run
   :func:`~quantwatch.service.alerts.columns.evaluate_rows` (numpy arrays per rule over the batch's layers), upsert
   the rows a sample advanced in one statement;
3. for the (rule, layer) groups whose series changed status: lock their group rows in sorted order (no deadlocks
   between replicas), re-read every rank's status (committed by whoever held the locks before), advance the
   episodes in memory, then write episodes, group pointers and outbox rows with a few bulk statements per batch
   (not a dozen per series: a flapping run moves hundreds of series per batch); when the run's firing episodes
   changed, redraw the rank's firing token last (:mod:`~quantwatch.service.alerts.firing`);
4. read the run's firing episodes for the ingest answer: the list this process kept, while the run's tokens are
   unchanged.

Everything commits with the points, or not at all; the delivery worker only ever sees committed notifications.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy.orm import Session

from quantwatch.service.alerts import repository
from quantwatch.service.alerts.cache import RuleCache
from quantwatch.service.alerts.columns import RankBatch, RuleStates, evaluate_rows
from quantwatch.service.alerts.episodes import Episode, EpisodeBatch, EpisodeFields, apply_event, json_value
from quantwatch.service.alerts.evaluator import (
    BatchColumns,
    MetricColumn,
    SeriesStatus,
    SeriesTransition,
    StepInput,
    advance_episode,
)
from quantwatch.service.alerts.firing import NO_FIRING, FiringList, FiringLists, redraw_firing_token
from quantwatch.service.alerts.formats import LayerFormatRecorder
from quantwatch.service.alerts.head import BatchHead, read_batch_head
from quantwatch.service.alerts.repository import insert_ignore
from quantwatch.service.alerts.rules import ReceiverSpec, Rule
from quantwatch.service.alerts.tables import EpisodeRow, ReceiverRow
from quantwatch.service.alerts.webhooks import Notification, alertmanager_body, webhook_body
from quantwatch.service.periodic import positive_seconds

if TYPE_CHECKING:
    from quantwatch.service.batch import IngestBatch, StoredRun

RemedyKey = tuple[str, int]
"""(layer, rank) of a notification's remediation: the layer on its lowest rank."""
Remediation = Callable[[Session, str, Sequence[RemedyKey]], Mapping[RemedyKey, str | None]]

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


@dataclass(frozen=True)
class _Staged:
    """The rows of series states one batch wrote, published to :meth:`AlertEngine.latest_states` once committed."""

    run: str
    rank: int
    written: dict[str, tuple[int, RuleStates]]


@dataclass
class _Pending:
    """What one evaluation leaves for after its commit: the series states to publish, whether it redrew the rank's
    firing token, the run's firing episodes for the ingest answer, and the ids of the outbox rows it wrote (leased to
    this process or not). An ingest batch's lives in its :attr:`~quantwatch.service.batch.IngestBatch.observed`, so
    a failed batch leaves nothing for the next one on its thread; the other writers' (``evaluate``, ``notify``) per
    thread."""

    staged: _Staged | None = None
    redrawn: bool = False
    firing: FiringList = NO_FIRING
    leased: list[int] = field(default_factory=list)
    unleased: list[int] = field(default_factory=list)

    def take_outbox(self) -> tuple[list[int], list[int]]:
        """The (leased, unleased) outbox ids recorded so far, then forgotten."""
        taken = self.leased, self.unleased
        self.leased, self.unleased = [], []
        return taken


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
        formats: LayerFormatRecorder | None = None,
        states_ttl_seconds: float = 3600.0,
    ) -> None:
        """``states_ttl_seconds``: how long the states of a (run, rank) that sends nothing stay in memory (see
        :meth:`latest_states`; the collector passes its ``metrics_run_ttl_seconds``)."""
        self.external_url = external_url
        self.delivery_horizon_seconds = delivery_horizon_seconds
        self.formats = formats if formats is not None else LayerFormatRecorder()
        """The layer formats' observer; it must see a batch before this engine does (see ``create_app``)."""
        self._clock = clock
        self._wake = wake
        self._dispatch = dispatch
        self._rules = RuleCache()
        self._firing = FiringLists()
        # The series state rows this process wrote last, by (run, rank) and rule name: (token, states), kept as the
        # evaluator's rows (replaced after a commit, never changed: the exposition reads them as they are).
        self._written: dict[tuple[str, int], dict[str, tuple[int, RuleStates]]] = {}
        # When each (run, rank)'s states were published last, and when the next look for idle ones is due: a
        # collector running for weeks sees thousands of (run, rank)s, each ~120 kB of states at 512 layers with the
        # shipped rules.
        self._published: dict[tuple[str, int], float] = {}
        self._states_ttl = positive_seconds("states_ttl_seconds", states_ttl_seconds)
        self._next_forget = 0.0
        self._latest_lock = threading.Lock()
        self._threads = threading.local()
        self.remediation: Remediation | None = None
        """``(session, run, keys) -> text by key``: the ``remediation`` annotation of the notifications of ``keys``,
        (layer, rank) pairs, all at once (a key left out or None: no remediation)."""

    # -- ingest observer ---------------------------------------------------------------------------------------
    def on_batch(self, session: Session, run_row: StoredRun, batch: IngestBatch) -> None:
        """:class:`~quantwatch.service.batch.IngestObserver` hook: evaluate inside the ingest transaction."""
        now = self._clock()
        # The ingest transaction holds the rank's write lock already: the head is read under it.
        head = read_batch_head(session, batch.run, batch.rank, run_row.id)

        def columns_of(metrics: Iterable[str], by_format: bool) -> BatchColumns:
            columns = batch_columns(batch, metrics, now)
            # The formats are read only when a rule selects by them or restarts a baseline at a change.
            if not by_format:
                return columns
            return replace(columns, formats=self.formats.current(session, run_row.id, head.format_rows).view())

        pending = batch.observed[self] = _Pending()
        self._evaluate(session, head, batch.run, batch.rank, batch.layers, columns_of, pending)
        # The ingest answer lists the run's firing episodes after this batch's own changes: the head's tokens are
        # those unless the batch redrew its own.
        pending.firing = self._firing.current(session, batch.run, None if pending.redrawn else head.firing_tokens)

    def firing_of(self, batch: IngestBatch) -> FiringList:
        """The run's firing episodes as ``batch``, once stored, left them: the ingest answer's ``firing_episodes``
        (empty for a batch the engine did not evaluate: a duplicate, or no rule matched)."""
        pending: _Pending | None = batch.observed.get(self)
        return NO_FIRING if pending is None else pending.firing

    def after_commit(self, batch: IngestBatch) -> None:
        """:class:`~quantwatch.service.batch.IngestObserver` hook: publish the committed series states to
        :meth:`latest_states` and hand new outbox rows to the delivery worker."""
        pending: _Pending | None = batch.observed.get(self)
        if pending is None:
            return
        staged, pending.staged = pending.staged, None
        if staged is not None:
            now = self._clock()
            with self._latest_lock:
                self._written.setdefault((staged.run, staged.rank), {}).update(staged.written)
                self._published[(staged.run, staged.rank)] = now
                if now >= self._next_forget:
                    self._forget_idle(now)
        self._send(pending)

    def _forget_idle(self, now: float) -> None:
        """Drop the states of the (run, rank)s that published none for ``states_ttl_seconds`` (the lock held): their
        next batch reads them from the database, and /metrics exports no run idle that long (the restore's series
        of the runs stored before a restart come from the database too). Looked at 8 times a TTL at most."""
        idle = [key for key, at in self._published.items() if at < now - self._states_ttl]
        for key in idle:
            del self._published[key]
            del self._written[key]
        self._next_forget = now + self._states_ttl / 8

    def send_enqueued(self) -> None:
        """After a commit of ``evaluate`` or ``notify``: dispatch the leased outbox rows this thread wrote and wake the
        worker for the others."""
        self._send(self._thread_pending())

    def _send(self, pending: _Pending) -> None:
        """Dispatch ``pending``'s leased outbox rows and wake the worker for the others (then forgotten)."""
        leased, unleased = pending.take_outbox()
        if leased and self._dispatch is not None:
            self._dispatch(leased)
        if unleased:
            self._wake()

    def _thread_pending(self) -> _Pending:
        """This thread's outbox ids of ``evaluate`` and ``notify`` (their callers commit, then ``send_enqueued``)."""
        pending: _Pending | None = getattr(self._threads, "pending", None)
        if pending is None:
            pending = self._threads.pending = _Pending()
        return pending

    def wake(self) -> None:
        """Wake the delivery worker (after a redelivery, say)."""
        self._wake()

    def evaluate(self, session: Session, run: str, rank: int, layers: Sequence[str], steps: Sequence[StepInput]) -> int:
        """Evaluate one batch given per step inside the caller's transaction; returns how many outbox rows it wrote."""
        repository.lock_cursor(session, run, rank)
        pending = self._thread_pending()
        pending.take_outbox()  # what a failed evaluation on this thread left behind
        return self._evaluate(
            session,
            read_batch_head(session, run, rank, None),
            run,
            rank,
            layers,
            lambda metrics, _: BatchColumns.from_steps(len(layers), steps, metrics),
            pending,
        )

    def _evaluate(
        self,
        session: Session,
        head: BatchHead,
        run: str,
        rank: int,
        layers: Sequence[str],
        columns_of: Callable[[Iterable[str], bool], BatchColumns],
        pending: _Pending,
    ) -> int:
        """Evaluate one batch of one (run, rank) whose lock the transaction holds, ``head`` read under it; what is
        left for after the commit goes to ``pending``."""
        active = self._rules.active_rules(session, head.rules)
        rules = [(rule_id, rule) for rule_id, rule in active if rule.matches_run(run)]
        if not rules:
            return 0
        by_format = any(rule.selects_formats or rule.baseline is not None for _, rule in rules)
        columns = columns_of({rule.metric for _, rule in rules if rule.metric is not None}, by_format)
        if not columns.steps:
            return 0
        ids = {rule.name: rule_id for rule_id, rule in rules}
        names = {rule_id: rule.name for rule_id, rule in rules}
        stored = self._stored_states(session, run, rank, names, head.series_tokens)
        rows, transitions = evaluate_rows([rule for _, rule in rules], RankBatch(run, rank, layers, columns), stored)
        written = repository.upsert_series_states(session, run, rank, ids, rows)
        pending.staged = _Staged(run, rank, written)
        if not transitions:
            return 0
        by_group: dict[tuple[int, str], list[SeriesTransition]] = {}
        for transition in transitions:
            by_group.setdefault((ids[transition.rule], transition.layer), []).append(transition)
        return self._advance_groups(session, dict(rules), run, rank, by_group, pending)

    def _stored_states(
        self, session: Session, run: str, rank: int, names: dict[int, str], tokens: Mapping[int, int]
    ) -> dict[str, RuleStates]:
        """The stored series states of one (run, rank) by rule name, given the tokens of its stored rows: those this
        process wrote last when their row's token is still the one it wrote (another replica's write draws another),
        the others decoded from the database."""
        states: dict[str, RuleStates] = {}
        unknown: dict[int, str] = {}
        with self._latest_lock:
            mine = self._written.get((run, rank), {})
            for rule_id, token in tokens.items():
                if rule_id not in names:
                    continue  # a rule that does not match the run
                cached = mine.get(names[rule_id])
                if cached is not None and cached[0] == token:
                    states[names[rule_id]] = cached[1]
                else:
                    unknown[rule_id] = names[rule_id]
        if unknown:
            for rule_id, (_, read) in repository.read_series_states(session, run, rank, unknown).items():
                states[names[rule_id]] = read
        return states

    def _advance_groups(
        self,
        session: Session,
        rules: dict[int, Rule],
        run: str,
        rank: int,
        by_group: dict[tuple[int, str], list[SeriesTransition]],
        pending: _Pending,
    ) -> int:
        """Episode events of every (rule, layer) that moved, with a handful of bulk statements for the whole batch."""
        keys = sorted(by_group)
        opened, statuses = repository.lock_groups(session, run, keys)
        episodes = repository.read_episodes(
            session, [episode_id for episode_id in opened.values() if episode_id is not None]
        )
        batch = EpisodeBatch()
        for key in keys:
            rule_id, layer = key
            episode_id = opened[key]
            episode = episodes.get(episode_id) if episode_id is not None else None
            group_statuses = statuses[key]
            for move in by_group[key]:
                group_statuses[move.rank] = move.after
                active = {of for of, status in group_statuses.items() if status is not SeriesStatus.INACTIVE}
                open_state = episode.state if episode is not None and episode.state != "resolved" else None
                for event in advance_episode(open_state, group_statuses.values()):  # type: ignore[arg-type]
                    episode = apply_event(
                        batch, event, episode, rule_id, rules[rule_id], run, layer, move, active, self._notify_new
                    )
                if episode is not None and episode.state != "resolved" and not active.issubset(episode.ranks):
                    batch.touch(episode)
                    episode.ranks = sorted(set(episode.ranks) | active)
            still_open = episode if episode is not None and episode.state != "resolved" else None
            batch.groups[key] = (episode_id, still_open)
        return self._write_episodes(session, rules, run, rank, batch, pending)

    def _write_episodes(
        self, session: Session, rules: dict[int, Rule], run: str, rank: int, batch: EpisodeBatch, pending: _Pending
    ) -> int:
        """Write what :meth:`_advance_groups` decided: episodes, group pointers, then the outbox rows."""
        self._remediate(session, batch)
        repository.write_episodes(session, run, batch)
        written = self._write_outbox(session, rules, batch, pending) if batch.notifications else 0
        if batch.changes_firing():
            redraw_firing_token(session, run, rank)  # the last lock of the batch's alert writes
            pending.redrawn = True
        return written

    def _remediate(self, session: Session, batch: EpisodeBatch) -> None:
        """Give the batch's notifications their remediation (one reading for all their layers: a wave of hundreds
        firing at once read two statements per layer), before the episodes' rows take their annotations from them."""
        if self.remediation is None or not batch.notifications:
            return
        keys = [(notification.layer, min(notification.ranks, default=0)) for _, notification in batch.notifications]
        texts = self.remediation(session, batch.notifications[0][1].run, list(dict.fromkeys(keys)))
        for index, ((episode, notification), key) in enumerate(zip(batch.notifications, keys, strict=True)):
            text = texts.get(key)
            if text is not None:
                sent = replace(notification, remediation=text)
                batch.notifications[index] = (episode, sent)
                if episode.notified is notification:
                    episode.notified = sent

    def _write_outbox(self, session: Session, rules: dict[int, Rule], batch: EpisodeBatch, pending: _Pending) -> int:
        now = self._clock()
        receivers = {
            rule_id: repository.receivers_for(session, rules[rule_id])
            for rule_id in sorted({episode.rule_id for episode, _ in batch.notifications})
        }
        if not any(receivers.values()):
            return 0
        waiting = repository.pending_deliveries(
            session, {episode.written_id() for episode, _ in batch.notifications if not episode.fresh}
        )
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
        ids = repository.insert_deliveries(session, rows)
        _record_enqueued(pending, [(ids[row["webhook_id"]], row["claimed_until"]) for row in rows])
        return len(rows)

    def notification(self, episode: EpisodeRow, rule: Rule, status: str) -> Notification:
        """The notification for ``episode`` in ``status`` (``firing`` or ``resolved``)."""
        return self._notification(episode, rule, status, episode.id)

    def _notify_new(self, episode: Episode, rule: Rule, status: str) -> Notification:
        """The notification of an episode this batch changed (its id is set once written)."""
        return self._notification(episode, rule, status, 0)

    def _notification(self, episode: EpisodeFields, rule: Rule, status: str, episode_id: int) -> Notification:
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
        if self.remediation is not None:
            key = (episode.layer, min(episode.ranks, default=0))
            notification = replace(notification, remediation=self.remediation(session, episode.run, [key]).get(key))
        episode.labels = notification.labels()
        episode.annotations = notification.annotations()
        receivers = repository.receivers_for(session, rule)
        now = self._clock()
        waiting = repository.pending_receivers(session, episode.id)
        rows = [
            self._delivery_values(notification, receiver, now, receiver.id in waiting)
            for receiver in receivers
            if status != "resolved" or receiver.send_resolved
        ]
        _record_enqueued(self._thread_pending(), repository.add_deliveries(session, rows))
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

    def take_enqueued(self) -> tuple[list[int], list[int]]:
        """Ids of the (leased, unleased) outbox rows this thread's ``evaluate`` and ``notify`` wrote since the last
        call (then forgotten)."""
        return self._thread_pending().take_outbox()

    # -- reads for Prometheus and the API ----------------------------------------------------------------------
    def latest_states(self) -> list[tuple[str, int, str, RuleStates]]:
        """(run, rank, rule name, states) of every rule's states of every (run, rank) this process evaluated in the last
        ``states_ttl_seconds`` (in memory, no database; a batch publishes new states objects, never changes them).

        For the Prometheus exposition's scrape path: current for the series this replica ingests, and as many
        objects as (run, rank, rule)s, not series (a rule on 512 layers of 64 ranks is 32,768 series: building an
        object for each held the GIL, and ingest with it, for 0.5 s a scrape). :meth:`series_snapshot` reads the
        authoritative state of all replicas from the database.
        """
        with self._latest_lock:
            return [
                (run, rank, rule, states)
                for (run, rank), rows in self._written.items()
                for rule, (_, states) in rows.items()
            ]

    def series_snapshot(self, session: Session, runs: Iterable[str] | None = None) -> list[SeriesSnapshot]:
        """Every series' streak and status (optionally for some runs) from the database, whichever replica wrote it."""
        snapshots = []
        for name, definition, run, rank, layer, state in repository.series_state_rows(session, runs):
            series = definition.get("metric") or definition.get("scalar") or ""
            snapshots.append(
                SeriesSnapshot(name, run, rank, layer, str(series), state.status.value, state.streak, state.last_step)
            )
        return snapshots


def _record_enqueued(pending: _Pending, rows: Iterable[tuple[int, float | None]]) -> None:
    """Remember the ids of outbox rows written, by (id, claimed_until), in ``pending``."""
    for row_id, claimed_until in rows:
        (pending.leased if claimed_until is not None else pending.unleased).append(row_id)


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
