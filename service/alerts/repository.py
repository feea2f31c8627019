"""The alerting part's data access: every SQL statement of alerts, on SQLite and PostgreSQL.

The ingest path (:class:`~quantwatch.service.alerts.engine.AlertEngine`) writes whole batches of rows through Core
statements, without the ORM's per-object bookkeeping: series states, group locks, episodes and outbox rows. The rule
and receiver catalogue (:mod:`~quantwatch.service.alerts.catalog`) reads and locks rows through the ORM.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import (
    Connection,
    Table,
    and_,
    bindparam,
    delete,
    exists,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased

from quantwatch.service.alerts.columns import STATUS_CODES, STATUSES, ColumnStates, RuleStates, stored_statuses
from quantwatch.service.alerts.episodes import EPISODE_READ, Episode, EpisodeBatch
from quantwatch.service.alerts.evaluator import SeriesState, SeriesStatus
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.tables import (
    SERIES_FIELDS,
    AlertCursorRow,
    AlertGroupRow,
    DeliveryRow,
    EpisodeRow,
    LayerFormatRow,
    ReceiverRow,
    RuleRow,
    SeriesStatesRow,
)
from quantwatch.service.core.driver_sql import conflict_statements, driver_upserts
from quantwatch.service.models import Run

__all__ = [
    "add_deliveries",
    "cancel_delivery",
    "claim_deliveries",
    "clear_rule_state",
    "decode_row",
    "decode_series",
    "disable_receiver",
    "draw_token",
    "encode_row",
    "encode_series",
    "firing_episode_counts",
    "insert_deliveries",
    "insert_ignore",
    "known_receivers",
    "layer_format_count",
    "layer_format_rows",
    "lock_cursor",
    "lock_groups",
    "open_episodes",
    "pending_deliveries",
    "pending_receivers",
    "read_episodes",
    "read_series_states",
    "receiver_by_name",
    "receivers_for",
    "receivers_from",
    "record_delivery_attempt",
    "record_layer_formats",
    "rule_by_name",
    "rule_definitions",
    "rules_for_update",
    "series_state_rows",
    "upsert_series_states",
    "write_episodes",
]

_CURSORS = cast(Table, AlertCursorRow.__table__)
_STATES = cast(Table, SeriesStatesRow.__table__)
_GROUPS = cast(Table, AlertGroupRow.__table__)
_EPISODES = cast(Table, EpisodeRow.__table__)
_DELIVERIES = cast(Table, DeliveryRow.__table__)
_ABSENT = (None,) * len(SERIES_FIELDS)
_TOKENS = 2**63 - 1  # a row's token is in [1, 2**63): 0 marks the rows migration 0008 carried over
_EPISODE_UPDATE = update(_EPISODES).where(_EPISODES.c.id == bindparam("b_id"))
_GROUP_UPDATE = update(_GROUPS).where(
    _GROUPS.c.rule_id == bindparam("b_rule_id"), _GROUPS.c.layer == bindparam("b_layer")
)


def insert_ignore(session: Session, table: Any, rows: list[dict[str, Any]], keys: Sequence[str]) -> None:
    """``INSERT … ON CONFLICT (keys) DO NOTHING`` on SQLite and PostgreSQL (a Core statement, one round of rows)."""
    if not rows:
        return
    conn = session.connection()
    dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    conn.execute(dialect_insert(table).on_conflict_do_nothing(index_elements=list(keys)), rows)


# Every batch that advances a sample writes its rank's rows: driver SQL compiled once (see DriverStatement).
_STATE_UPSERTS = driver_upserts(_STATES, ("rule_id", "run", "rank"), ("token", "series"))


def draw_token() -> int:
    """A new random row token in [1, 2**63) (0 marks the rows migration 0008 carried over): the series states' and
    the firing lists' (:mod:`~quantwatch.service.alerts.firing`)."""
    return secrets.randbelow(_TOKENS) + 1


# -- the ingest path -------------------------------------------------------------------------------------------------
_RULES = cast(Table, RuleRow.__table__)
_DEFINITIONS = select(_RULES.c.id, _RULES.c.definition).where(_RULES.c.id.in_(bindparam("ids", expanding=True)))
_CURSOR_INSERTS = conflict_statements(_CURSORS, ("run", "rank"))
_CURSOR_LOCK = (
    select(_CURSORS.c.run)
    .where(_CURSORS.c.run == bindparam("run"), _CURSORS.c.rank == bindparam("rank"))
    .with_for_update()
)


def rule_definitions(session: Session, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The definitions of the rules ``ids``, by id."""
    rows = session.connection().execute(_DEFINITIONS, {"ids": list(ids)})
    return {int(rule_id): definition for rule_id, definition in rows}


def lock_cursor(session: Session, run: str, rank: int) -> None:
    """Create and lock the (run, rank) cursor row: replicas ingesting that rank take turns from here on."""
    conn = session.connection()
    conn.execute(_CURSOR_INSERTS[conn.dialect.name], {"run": run, "rank": rank})
    conn.execute(_CURSOR_LOCK, {"run": run, "rank": rank}).all()


def encode_series(state: SeriesState) -> list[Any]:
    """One series' state as stored in :attr:`~quantwatch.service.alerts.tables.SeriesStatesRow.series`."""
    value = state.last_value if state.last_value is None or math.isfinite(state.last_value) else None
    fields = [STATUS_CODES[state.status], state.last_step, state.streak, state.clear_streak]
    if state.baseline or state.baseline_since is not None:
        return [*fields, value, list(state.baseline) or None, state.baseline_since]
    return fields if value is None else [*fields, value]


def decode_series(fields: Sequence[Any]) -> SeriesState:
    """The state :func:`encode_series` stored."""
    padded: list[Any] = [*fields, *_ABSENT[len(fields) :]]
    status, last_step, streak, clear_streak, last_value, baseline, baseline_since = padded
    return SeriesState(
        STATUSES[status], last_step, streak, clear_streak, last_value, tuple(baseline or ()), baseline_since
    )


StoredStates = dict[int, tuple[int, RuleStates]]
"""Per rule id: the token of its (run, rank) row and the row's series states, keyed (rule name, layer)."""


def decode_row(rule: str, series: dict[str, list[Any]] | list[Any]) -> RuleStates:
    """The states of one stored row of the rule ``rule``: columns (a list: metric rules without a baseline) or
    per-layer states (an object: baseline and scalar rules, and rows written before the columnar encoding)."""
    if isinstance(series, list):
        return ColumnStates.decode(rule, series)
    return {(rule, layer): decode_series(fields) for layer, fields in series.items()}


def encode_row(states: RuleStates) -> dict[str, list[Any]] | list[Any]:
    """The stored form of one rule's states (see :func:`decode_row`)."""
    if isinstance(states, ColumnStates):
        return states.encode()
    return {layer: encode_series(state) for (_, layer), state in states.items()}


def read_series_states(session: Session, run: str, rank: int, names: Mapping[int, str]) -> StoredStates:
    """The stored rows of one (run, rank) for the rules ``names`` (id → name)."""
    query = select(_STATES.c.rule_id, _STATES.c.token, _STATES.c.series).where(
        _STATES.c.run == run, _STATES.c.rank == rank, _STATES.c.rule_id.in_(list(names))
    )
    return {
        rule_id: (token, decode_row(names[rule_id], series))
        for rule_id, token, series in session.connection().execute(query)
    }


def upsert_series_states(
    session: Session, run: str, rank: int, ids: Mapping[str, int], rows: Mapping[str, RuleStates]
) -> dict[str, tuple[int, RuleStates]]:
    """Write the rows of one (run, rank) that changed: each rule's complete states (``rows``, by rule name mapped to
    ids by ``ids``), under a new token. Returns what it wrote: (token, states) by rule name."""
    written = {name: (draw_token(), states) for name, states in rows.items()}
    values = [
        {"rule_id": ids[name], "run": run, "rank": rank, "token": token, "series": encode_row(states)}
        for name, (token, states) in written.items()
    ]
    if values:
        conn = session.connection()
        _STATE_UPSERTS[conn.dialect.name].execute(conn, values)
    return written


GroupKey = tuple[int, str]


def lock_groups(
    session: Session, run: str, keys: Sequence[GroupKey]
) -> tuple[dict[GroupKey, int | None], dict[GroupKey, dict[int, SeriesStatus]]]:
    """Lock the (rule, layer) groups ``keys`` (sorted) of ``run``; their open episode ids and every rank's status.

    The statuses are read after the locks, so they include what whoever held them before committed.
    """
    conn = session.connection()
    layers_by_rule: dict[int, list[str]] = {}
    for rule_id, layer in keys:
        layers_by_rule.setdefault(rule_id, []).append(layer)
    statuses: dict[GroupKey, dict[int, SeriesStatus]] = {key: {} for key in keys}
    if conn.dialect.name == "postgresql":
        # Every group row exists before the first lock, so the locks are taken in one order everywhere.
        _create_groups(session, run, keys)
        opened = _locked_groups(conn, run, layers_by_rule)
    else:
        # SQLite: the batch's transaction holds the database's write lock already; create only the missing groups
        # (a rule's groups exist after its first episode on the run: inserting them all again cost more than the
        # rest of a rank's first batch).
        opened = _locked_groups(conn, run, layers_by_rule)
        missing = [key for key in keys if key not in opened]
        _create_groups(session, run, missing)
        opened.update(dict.fromkeys(missing))
    # Every rank's row of the moved rules in one statement, after all the locks.
    for rule_id, rank, series in conn.execute(
        select(_STATES.c.rule_id, _STATES.c.rank, _STATES.c.series).where(
            _STATES.c.rule_id.in_(list(layers_by_rule)), _STATES.c.run == run
        )
    ):
        for layer, code in stored_statuses(series, layers_by_rule[rule_id]).items():
            statuses[(rule_id, layer)][rank] = STATUSES[code]
    return opened, statuses


# PostgreSQL: one statement over arrays where an executemany would run one per row (psycopg pipelines them, but a
# rank's first batch joins hundreds of groups and episodes, all under the groups' locks that the other ranks wait on).
_PG_GROUPS = text(
    "INSERT INTO alert_groups (rule_id, run, layer, episode_id) "
    "SELECT g.rule_id, :run, g.layer, NULL FROM unnest(CAST(:rule_ids AS integer[]), CAST(:layers AS varchar[])) "
    "WITH ORDINALITY AS g(rule_id, layer, position) ORDER BY g.position "
    "ON CONFLICT (rule_id, run, layer) DO NOTHING"
)
_PG_RANKS = text(
    "UPDATE alert_episodes SET ranks = CAST(e.ranks AS json) "
    "FROM unnest(CAST(:ids AS integer[]), CAST(:ranks AS text[])) AS e(id, ranks) WHERE alert_episodes.id = e.id"
)


def _create_groups(session: Session, run: str, keys: Sequence[GroupKey]) -> None:
    """Create the group rows of ``keys`` that do not exist, in the order of ``keys``."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        if keys:
            rule_ids, layers = [rule_id for rule_id, _ in keys], [layer for _, layer in keys]
            conn.execute(_PG_GROUPS, {"run": run, "rule_ids": rule_ids, "layers": layers})
        return
    rows = [{"rule_id": rule_id, "run": run, "layer": layer, "episode_id": None} for rule_id, layer in keys]
    insert_ignore(session, _GROUPS, rows, ("rule_id", "run", "layer"))


def _locked_groups(conn: Connection, run: str, layers_by_rule: Mapping[int, list[str]]) -> dict[GroupKey, int | None]:
    """Lock the stored groups of ``layers_by_rule`` (rule id → sorted layers) of ``run``; their open episode ids."""
    opened: dict[GroupKey, int | None] = {}
    for rule_id, layers in layers_by_rule.items():
        # Lock the groups in (rule, layer) order, the same order in every replica: no deadlocks between them.
        for layer, episode_id in conn.execute(
            select(_GROUPS.c.layer, _GROUPS.c.episode_id)
            .where(_GROUPS.c.rule_id == rule_id, _GROUPS.c.run == run, _GROUPS.c.layer.in_(layers))
            .order_by(_GROUPS.c.layer)
            .with_for_update()
        ):
            opened[(rule_id, layer)] = episode_id
    return opened


def read_episodes(session: Session, ids: list[int]) -> dict[int, Episode]:
    """The episodes ``ids`` in memory, by id (all but their labels and annotations: see ``EPISODE_READ``)."""
    if not ids:
        return {}
    columns = [_EPISODES.c[name] for name in EPISODE_READ]
    return {
        int(row[0]): Episode(int(row[0]), *row[1:])
        for row in session.connection().execute(select(_EPISODES.c.id, *columns).where(_EPISODES.c.id.in_(ids)))
    }


def write_episodes(session: Session, run: str, batch: EpisodeBatch) -> None:
    """Write what a batch decided: changed and dropped episodes, new ones (their ids set), then group pointers."""
    conn = session.connection()
    existing = [episode for episode in batch.touched if not episode.fresh]
    # Ended and dropped episodes first: a group's new open episode must not meet its old one in the unique index.
    kept = [episode for episode in existing if not episode.cancelled]
    # One statement per shape of the changes: fired or resolved (notified), or joined by a rank (see update_values).
    notified = [episode.update_values() for episode in kept if episode.notified is not None]
    if notified:
        conn.execute(_EPISODE_UPDATE, notified)
    joined = [episode for episode in kept if episode.notified is None]
    if joined and conn.dialect.name == "postgresql":
        ranks = [json.dumps(episode.ranks) for episode in joined]
        conn.execute(_PG_RANKS, {"ids": [episode.id for episode in joined], "ranks": ranks})
    elif joined:
        conn.execute(_EPISODE_UPDATE, [episode.update_values() for episode in joined])
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


def pending_deliveries(session: Session, episode_ids: Iterable[int]) -> set[tuple[int, int]]:
    """(episode id, receiver id) of the pending outbox rows of ``episode_ids``."""
    ids = sorted(episode_ids)
    if not ids:
        return set()
    return {
        (int(episode_id), int(receiver_id))
        for episode_id, receiver_id in session.connection().execute(
            select(_DELIVERIES.c.episode_id, _DELIVERIES.c.receiver_id).where(
                _DELIVERIES.c.episode_id.in_(ids), _DELIVERIES.c.status == "pending"
            )
        )
    }


def insert_deliveries(session: Session, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Insert outbox rows in one statement; their ids by webhook id."""
    # Matched back by webhook id (unique): an ordered RETURNING would make SQLite insert row by row.
    returned = session.connection().execute(
        insert(_DELIVERIES).returning(_DELIVERIES.c.webhook_id, _DELIVERIES.c.id), rows
    )
    return {str(webhook_id): int(row_id) for webhook_id, row_id in returned}


def receivers_for(session: Session, rule: Rule) -> list[ReceiverRow]:
    """The enabled receivers a rule notifies (all of them when it names none), by id."""
    query = select(ReceiverRow).where(ReceiverRow.enabled.is_(True))
    if rule.receivers:
        query = query.where(ReceiverRow.name.in_(rule.receivers))
    return list(session.scalars(query.order_by(ReceiverRow.id)))


def pending_receivers(session: Session, episode_id: int) -> set[int]:
    """Ids of the receivers with a pending outbox row of ``episode_id``."""
    return set(
        session.scalars(
            select(DeliveryRow.receiver_id).where(DeliveryRow.episode_id == episode_id, DeliveryRow.status == "pending")
        )
    )


def add_deliveries(session: Session, rows: list[dict[str, Any]]) -> list[tuple[int, float | None]]:
    """Add outbox rows through the session (flushed); (id, claimed_until) of each."""
    added = [DeliveryRow(**values) for values in rows]
    session.add_all(added)
    session.flush()
    return [(row.id, row.claimed_until) for row in added]


def series_state_rows(
    session: Session, runs: Iterable[str] | None = None
) -> list[tuple[str, dict[str, Any], str, int, str, SeriesState]]:
    """Every stored series state (optionally of some runs): (rule name, rule definition, run, rank, layer, state)."""
    query = select(RuleRow.name, RuleRow.definition, _STATES.c.run, _STATES.c.rank, _STATES.c.series).join(
        RuleRow, RuleRow.id == _STATES.c.rule_id
    )
    if runs is not None:
        query = query.where(_STATES.c.run.in_(list(runs)))
    return [
        (name, definition, run, rank, layer, state)
        for name, definition, run, rank, series in session.execute(query)
        for (_, layer), state in decode_row(name, series).items()
    ]


# -- the delivery worker --------------------------------------------------------------------------------------------
def claim_deliveries(session: Session, now: float, limit: int, until: float) -> list[int]:
    """Lease up to ``limit`` due outbox rows to the caller until ``until``; their ids, oldest due first.

    A row waits while an earlier one of the same (episode, receiver) is pending (notifications stay in order); rows
    another worker has locked are skipped.
    """
    earlier = aliased(DeliveryRow)
    blocked = exists().where(
        and_(
            earlier.episode_id == DeliveryRow.episode_id,
            earlier.receiver_id == DeliveryRow.receiver_id,
            earlier.id < DeliveryRow.id,
            earlier.status == "pending",
        )
    )
    ids = list(
        session.scalars(
            select(DeliveryRow.id)
            .where(
                DeliveryRow.status == "pending",
                DeliveryRow.next_attempt_at <= now,
                (DeliveryRow.claimed_until.is_(None)) | (DeliveryRow.claimed_until < now),
                ~blocked,
            )
            .order_by(DeliveryRow.next_attempt_at, DeliveryRow.id)
            .limit(limit)
            .with_for_update(skip_locked=True, of=DeliveryRow)
        )
    )
    if ids:
        session.execute(update(DeliveryRow).where(DeliveryRow.id.in_(ids)).values(claimed_until=until))
    return ids


def cancel_delivery(session: Session, delivery_id: int, reason: str) -> None:
    """Give up an outbox row without sending it."""
    session.execute(
        update(DeliveryRow)
        .where(DeliveryRow.id == delivery_id)
        .values(status="cancelled", claimed_until=None, last_error=reason)
    )


def record_delivery_attempt(session: Session, delivery_id: int, values: Mapping[str, object]) -> None:
    """Write the outcome of one attempt (status, attempts, next attempt, last error …) on an outbox row."""
    session.execute(update(DeliveryRow).where(DeliveryRow.id == delivery_id).values(**values))


def disable_receiver(session: Session, receiver_id: int, reason: str) -> None:
    """Disable a receiver (a 410 answer) and cancel its pending outbox rows."""
    session.execute(
        update(ReceiverRow).where(ReceiverRow.id == receiver_id).values(enabled=False, disabled_reason=reason)
    )
    session.execute(
        update(DeliveryRow)
        .where(DeliveryRow.receiver_id == receiver_id, DeliveryRow.status == "pending")
        .values(status="cancelled", last_error="receiver disabled after 410 Gone")
    )


# -- the catalogue of rules and receivers ----------------------------------------------------------------------------
def open_episodes(session: Session, rule_id: int) -> list[EpisodeRow]:
    """The pending and firing episodes of a rule."""
    return list(
        session.scalars(
            select(EpisodeRow).where(EpisodeRow.rule_id == rule_id, EpisodeRow.state.in_(("pending", "firing")))
        )
    )


def clear_rule_state(session: Session, rule_id: int) -> None:
    """Delete a rule's series states and group rows (its series start from scratch)."""
    session.execute(delete(SeriesStatesRow).where(SeriesStatesRow.rule_id == rule_id))
    session.execute(delete(AlertGroupRow).where(AlertGroupRow.rule_id == rule_id))


def known_receivers(session: Session, names: Sequence[str]) -> set[str]:
    """Which of ``names`` are stored receivers."""
    return set(session.scalars(select(ReceiverRow.name).where(ReceiverRow.name.in_(list(names)))))


def rule_by_name(session: Session, name: str) -> RuleRow | None:
    """The rule row of that name, locked for update."""
    return session.scalars(select(RuleRow).where(RuleRow.name == name).with_for_update()).one_or_none()


def receiver_by_name(session: Session, name: str, *, for_update: bool = False) -> ReceiverRow | None:
    """The receiver row of that name (locked when ``for_update``)."""
    query = select(ReceiverRow).where(ReceiverRow.name == name)
    return session.scalars(query.with_for_update() if for_update else query).one_or_none()


def receivers_from(session: Session, source: str) -> list[ReceiverRow]:
    """The receivers that came from ``source`` (``file`` or ``api``)."""
    return list(session.scalars(select(ReceiverRow).where(ReceiverRow.source == source)))


def rules_for_update(session: Session) -> dict[str, RuleRow]:
    """Every rule row by name, locked in name order."""
    return {row.name: row for row in session.scalars(select(RuleRow).order_by(RuleRow.name).with_for_update())}


def firing_episode_counts(session: Session, runs: Sequence[str]) -> dict[str, int]:
    """The number of firing episodes of each of ``runs`` that has any."""
    rows = session.execute(
        select(EpisodeRow.run, func.count())
        .where(EpisodeRow.state == "firing", EpisodeRow.run.in_(list(runs)))
        .group_by(EpisodeRow.run)
    )
    return {run: int(total) for run, total in rows}


# -- layer formats ---------------------------------------------------------------------------------------------------
_LAYER_FORMATS = cast(Table, LayerFormatRow.__table__)


def record_layer_formats(session: Session, rows: list[dict[str, Any]]) -> None:
    """Insert format changes (run_id, layer, kind, step, format, recorded_at); one already recorded is kept."""
    insert_ignore(session, _LAYER_FORMATS, rows, ("run_id", "layer", "kind", "step"))


_FORMAT_COUNT = select(func.count()).select_from(_LAYER_FORMATS).where(_LAYER_FORMATS.c.run_id == bindparam("run_id"))


def layer_format_count(session: Session, run_id: int) -> int:
    """How many format changes a run has recorded (the cheap check that a cached history is current)."""
    return int(session.connection().execute(_FORMAT_COUNT, {"run_id": run_id}).scalar_one())


def layer_format_rows(session: Session, run: int | str) -> list[tuple[str, str, int, str]]:
    """(layer, kind, step, format) of every format change of a run (by id or name), in step order."""
    query = select(_LAYER_FORMATS.c.layer, _LAYER_FORMATS.c.kind, _LAYER_FORMATS.c.step, _LAYER_FORMATS.c.format)
    if isinstance(run, str):
        query = query.join(Run, Run.id == _LAYER_FORMATS.c.run_id).where(Run.name == run)
    else:
        query = query.where(_LAYER_FORMATS.c.run_id == run)
    order = (_LAYER_FORMATS.c.step, _LAYER_FORMATS.c.layer, _LAYER_FORMATS.c.kind)
    return [(layer, kind, int(step), fmt) for layer, kind, step, fmt in session.execute(query.order_by(*order))]
