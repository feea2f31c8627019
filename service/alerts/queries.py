"""Data access behind the alert routes (``/api/v1/alerts``, ``/deliveries``, ``/rules``, ``/receivers``): the listings,
lookups by name, the catalog writes in their transactions, and redelivery.

Each function opens and closes its own session and answers the API's schemas, so the routes hold no SQL and no
transaction. Unknown names raise :class:`~quantwatch.service.alerts.catalog.NotFoundError`; an unknown delivery raises
the store's :class:`~quantwatch.service.store.NotFoundError` (a 404 from the app's handler).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from quantwatch.service.alerts.catalog import NotFoundError, delete_receiver, delete_rule, put_receiver, put_rule
from quantwatch.service.alerts.columns import RuleStates
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.repository import decode_row
from quantwatch.service.alerts.rules import ReceiverSpec, Rule
from quantwatch.service.alerts.schemas import AlertOut, DeliveryOut, ReceiverOut, RuleOut
from quantwatch.service.alerts.tables import (
    SERIES_STATUSES,
    DeliveryRow,
    EpisodeRow,
    ReceiverRow,
    RuleRow,
    SeriesStatesRow,
)
from quantwatch.service.core.db import write_session
from quantwatch.service.store import NotFoundError as UnknownDeliveryError

SelectT = TypeVar("SelectT", bound=Select[*tuple[Any, ...]])
NamedRow = TypeVar("NamedRow", RuleRow, ReceiverRow)
OutT = TypeVar("OutT")
Factory = sessionmaker[Session]


class ReceiverDisabledError(RuntimeError):
    """A delivery's receiver is disabled, so it cannot be sent again (HTTP 409)."""


def _only(query: SelectT, *filters: tuple[InstrumentedAttribute[Any], object | None]) -> SelectT:
    """``query`` narrowed to ``column == value`` for each filter whose value the caller gave (not None)."""
    for column, value in filters:
        if value is not None:
            query = query.where(column == value)
    return query


def _find_named(session: Session, table: type[NamedRow], name: str) -> NamedRow:
    row = session.scalars(select(table).where(table.name == name)).one_or_none()
    if row is None:
        raise NotFoundError(name)
    return row


class NamedReads(Generic[NamedRow, OutT]):
    """The reads of one catalog table whose rows are named (rules, receivers), answered as ``out`` makes them."""

    def __init__(self, table: type[NamedRow], out: Callable[[NamedRow], OutT]) -> None:
        self.table: type[NamedRow] = table
        self.out: Callable[[NamedRow], OutT] = out

    def list(self, factory: Factory) -> list[OutT]:
        """Every row, by name."""
        with factory() as session:
            return [self.out(row) for row in session.scalars(select(self.table).order_by(self.table.name))]

    def get(self, factory: Factory, name: str) -> OutT:
        """The row called ``name`` (raises NotFoundError)."""
        with factory() as session:
            return self.out(_find_named(session, self.table, name))


RULES = NamedReads(RuleRow, RuleOut.of)
"""Rules as the API shows them: shipped defaults, rules-file rules and API rules, enabled or not."""
RECEIVERS = NamedReads(ReceiverRow, ReceiverOut.of)
"""Receivers as the API shows them: without secrets or header values (see ReceiverOut)."""


def list_alerts(factory: Factory, state: str | None, run: str | None, rule: str | None, limit: int) -> list[AlertOut]:
    """Alert episodes, newest first, narrowed to the given state, run and rule.

    An open episode's latest step is read from its series (one per rank, in the (rule, run, rank) state rows), whose
    state the evaluator keeps with the newest step it saw: the episode row itself changes only at transitions."""
    query = _only(
        select(EpisodeRow).order_by(EpisodeRow.id.desc()).limit(limit),
        (EpisodeRow.state, state),
        (EpisodeRow.run, run),
        (EpisodeRow.rule_name, rule),
    )
    with factory() as session:
        episodes = list(session.scalars(query))
        open_keys = {(e.rule_id, e.run) for e in episodes if e.state in SERIES_STATUSES}
        rule_names = {e.rule_id: e.rule_name for e in episodes}
        states: dict[tuple[int | None, str], list[RuleStates]] = {}
        if open_keys:
            rows = session.execute(
                select(SeriesStatesRow.rule_id, SeriesStatesRow.run, SeriesStatesRow.series).where(
                    SeriesStatesRow.rule_id.in_({rule_id for rule_id, _ in open_keys}),
                    SeriesStatesRow.run.in_({name for _, name in open_keys}),
                )
            )
            for rule_id, name, series in rows:
                states.setdefault((rule_id, name), []).append(decode_row(rule_names[rule_id], series))
        return [AlertOut.of(e, _seen_step(e, states.get((e.rule_id, e.run), []))) for e in episodes]


def _seen_step(episode: EpisodeRow, ranks: list[RuleStates]) -> int | None:
    """The newest step at which a rank's series of the episode's layer was in the episode's state (None: none)."""
    if episode.state not in SERIES_STATUSES:
        return None
    key = (episode.rule_name, episode.layer)
    steps = [
        state.last_step
        for states in ranks
        if (state := states.get(key)) is not None and state.status == episode.state and state.last_step is not None
    ]
    return max(steps, default=None)


def list_deliveries(
    factory: Factory, status: str | None, receiver: str | None, episode: int | None, limit: int
) -> list[DeliveryOut]:
    """The delivery log, newest first, narrowed to the given status, receiver and episode."""
    query = _only(
        select(DeliveryRow, ReceiverRow.name)
        .join(ReceiverRow, ReceiverRow.id == DeliveryRow.receiver_id)
        .order_by(DeliveryRow.id.desc())
        .limit(limit),
        (DeliveryRow.status, status),
        (ReceiverRow.name, receiver),
        (DeliveryRow.episode_id, episode),
    )
    with factory() as session:
        return [DeliveryOut.of(row, name) for row, name in session.execute(query)]


def redeliver(factory: Factory, delivery_id: int, horizon_seconds: float) -> DeliveryOut:
    """Make delivery ``delivery_id`` pending again now (same body and ``webhook-id``) with a fresh retry horizon of
    ``horizon_seconds``; raises UnknownDeliveryError or ReceiverDisabledError. The caller wakes the sender."""
    now = time.time()
    with write_session(factory) as session:
        found = session.execute(
            select(DeliveryRow, ReceiverRow)
            .join(ReceiverRow, ReceiverRow.id == DeliveryRow.receiver_id)
            .where(DeliveryRow.id == delivery_id)
            .with_for_update(of=DeliveryRow)
        ).one_or_none()
        if found is None:
            raise UnknownDeliveryError(f"no delivery {delivery_id}")
        row, receiver = found
        if not receiver.enabled:
            raise ReceiverDisabledError(
                f"receiver {receiver.name!r} is disabled ({receiver.disabled_reason or 'by its config'})"
            )
        row.status, row.next_attempt_at, row.claimed_until = "pending", now, None
        row.expires_at = now + horizon_seconds
        row.last_error = None
        session.flush()
        return DeliveryOut.of(row, receiver.name)


def save_rule(factory: Factory, alerts: AlertEngine, rule: Rule, *, create: bool) -> RuleOut:
    """Create (``create=True``) or replace a rule in one transaction (raises ConflictError, NotFoundError)."""
    with write_session(factory) as session:
        return RuleOut.of(put_rule(session, alerts, rule, create=create))


def remove_rule(factory: Factory, alerts: AlertEngine, name: str) -> None:
    """Delete an API rule or disable a default or rules-file rule, in one transaction (raises NotFoundError)."""
    with write_session(factory) as session:
        delete_rule(session, alerts, name)


def save_receiver(factory: Factory, spec: ReceiverSpec, *, create: bool) -> ReceiverOut:
    """Create (``create=True``) or replace a receiver in one transaction (raises ConflictError, NotFoundError)."""
    with write_session(factory) as session:
        return ReceiverOut.of(put_receiver(session, spec, create=create))


def remove_receiver(factory: Factory, name: str) -> None:
    """Delete a receiver and its undelivered notifications, in one transaction (raises NotFoundError)."""
    with write_session(factory) as session:
        delete_receiver(session, name)
