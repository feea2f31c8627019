"""``/api/v1/alerts`` (episodes) and ``/api/v1/deliveries`` (the outbox, with replay)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar, Unpack

from fastapi import APIRouter, Depends, Path, Query, Request
from sqlalchemy import Select, select
from sqlalchemy.orm import InstrumentedAttribute

from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.schemas import AlertOut, DeliveryOut
from quantwatch.service.alerts.tables import DeliveryRow, EpisodeRow, ReceiverRow
from quantwatch.service.api.deps import AdminAuth, ReadAuth, StoreDep, reject_nul
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.core.db import write_session

REDELIVER: dict[int | str, dict[str, Any]] = {
    404: {"description": "Unknown delivery"},
    409: {"description": "The receiver is disabled"},
}

router = APIRouter(prefix="/api/v1", tags=["alerts"], dependencies=[Depends(reject_nul)])
SelectT = TypeVar("SelectT", bound=Select[Unpack[tuple[Any, ...]]])

DeliveryId = Annotated[int, Path(ge=1, le=2**31 - 1, description="Delivery id (from GET /api/v1/deliveries).")]
EpisodeId = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Only this alert episode.")]
Limit = Annotated[int, Query(ge=1, le=10_000, description="Most recent first, at most this many.")]


def _only(query: SelectT, *filters: tuple[InstrumentedAttribute[Any], object | None]) -> SelectT:
    """``query`` narrowed to ``column == value`` for each filter whose value the caller gave (not None)."""
    for column, value in filters:
        if value is not None:
            query = query.where(column == value)
    return query


@router.get("/alerts", response_model=list[AlertOut], dependencies=[ReadAuth])
def list_alerts(
    store: StoreDep,
    state: Annotated[Literal["pending", "firing", "resolved"] | None, Query(description="Only this state.")] = None,
    run: Annotated[str | None, Query(description="Only this run.")] = None,
    rule: Annotated[str | None, Query(description="Only this rule.")] = None,
    limit: Limit = 500,
) -> list[AlertOut]:
    """Alert episodes, newest first, with the step and time of each transition."""
    query = _only(
        select(EpisodeRow).order_by(EpisodeRow.id.desc()).limit(limit),
        (EpisodeRow.state, state),
        (EpisodeRow.run, run),
        (EpisodeRow.rule_name, rule),
    )
    with store.factory() as session:
        return [AlertOut.of(row) for row in session.scalars(query)]


@router.get("/deliveries", response_model=list[DeliveryOut], dependencies=[ReadAuth])
def list_deliveries(
    store: StoreDep,
    status: Annotated[
        Literal["pending", "delivered", "failed", "cancelled"] | None, Query(description="Only this status.")
    ] = None,
    receiver: Annotated[str | None, Query(description="Only this receiver.")] = None,
    episode: EpisodeId = None,
    limit: Limit = 500,
) -> list[DeliveryOut]:
    """The delivery log, newest first."""
    query = _only(
        select(DeliveryRow, ReceiverRow.name)
        .join(ReceiverRow, ReceiverRow.id == DeliveryRow.receiver_id)
        .order_by(DeliveryRow.id.desc())
        .limit(limit),
        (DeliveryRow.status, status),
        (ReceiverRow.name, receiver),
        (DeliveryRow.episode_id, episode),
    )
    with store.factory() as session:
        return [DeliveryOut.of(row, name) for row, name in session.execute(query)]


@router.post(
    "/deliveries/{delivery_id}/redeliver",
    response_model=DeliveryOut,
    status_code=202,
    dependencies=[AdminAuth],
    responses=REDELIVER,
)
def redeliver(delivery_id: DeliveryId, store: StoreDep, request: Request) -> DeliveryOut:
    """Send a delivery again (same body and ``webhook-id``), with a fresh retry horizon."""
    alerts: AlertEngine = request.app.state.alerts
    now = time.time()
    with write_session(store.factory) as session:
        found = session.execute(
            select(DeliveryRow, ReceiverRow)
            .join(ReceiverRow, ReceiverRow.id == DeliveryRow.receiver_id)
            .where(DeliveryRow.id == delivery_id)
            .with_for_update(of=DeliveryRow)
        ).one_or_none()
        if found is None:
            raise ProblemError(404, f"no delivery {delivery_id}")
        row, receiver = found
        if not receiver.enabled:
            raise ProblemError(
                409, f"receiver {receiver.name!r} is disabled ({receiver.disabled_reason or 'by its config'})"
            )
        row.status, row.next_attempt_at, row.claimed_until = "pending", now, None
        row.expires_at = now + alerts.delivery_horizon_seconds
        row.last_error = None
        session.flush()
        answer = DeliveryOut.of(row, receiver.name)
    alerts.wake()
    return answer
