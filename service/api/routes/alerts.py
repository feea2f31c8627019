"""``/api/v1/alerts`` (episodes) and ``/api/v1/deliveries`` (the outbox, with replay)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query

from quantwatch.service.alerts import queries
from quantwatch.service.alerts.schemas import AlertOut, DeliveryOut
from quantwatch.service.api.deps import AdminAuth, AlertsDep, ReadAuth, StoreDep, reject_nul
from quantwatch.service.api.problems import ProblemError

REDELIVER: dict[int | str, dict[str, Any]] = {
    404: {"description": "Unknown delivery"},
    409: {"description": "The receiver is disabled"},
}

router = APIRouter(prefix="/api/v1", tags=["alerts"], dependencies=[Depends(reject_nul)])

DeliveryId = Annotated[int, Path(ge=1, le=2**31 - 1, description="Delivery id (from GET /api/v1/deliveries).")]
EpisodeId = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Only this alert episode.")]
Limit = Annotated[int, Query(ge=1, le=10_000, description="Most recent first, at most this many.")]


@router.get("/alerts", response_model=list[AlertOut], dependencies=[ReadAuth])
def list_alerts(
    store: StoreDep,
    state: Annotated[Literal["pending", "firing", "resolved"] | None, Query(description="Only this state.")] = None,
    run: Annotated[str | None, Query(description="Only this run.")] = None,
    rule: Annotated[str | None, Query(description="Only this rule.")] = None,
    limit: Limit = 500,
) -> list[AlertOut]:
    """Alert episodes, newest first, with the step and time of each transition."""
    return queries.list_alerts(store.factory, state, run, rule, limit)


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
    return queries.list_deliveries(store.factory, status, receiver, episode, limit)


@router.post(
    "/deliveries/{delivery_id}/redeliver",
    response_model=DeliveryOut,
    status_code=202,
    dependencies=[AdminAuth],
    responses=REDELIVER,
)
def redeliver(delivery_id: DeliveryId, store: StoreDep, alerts: AlertsDep) -> DeliveryOut:
    """Send a delivery again (same body and ``webhook-id``), with a fresh retry horizon."""
    try:
        answer = queries.redeliver(store.factory, delivery_id, alerts.delivery_horizon_seconds)
    except queries.ReceiverDisabledError as exc:
        raise ProblemError(409, str(exc)) from None
    alerts.wake()
    return answer
