"""Liveness and readiness probes (no token needed: orchestrators call them)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.exc import SQLAlchemyError

from quantwatch.service.api.deps import StoreDep
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"description": "database unreachable"}})
def readyz(store: StoreDep) -> Health:
    """The database answers."""
    try:
        store.ping()
    except SQLAlchemyError as exc:
        raise ProblemError(503, f"database unreachable: {type(exc).__name__}", headers={"Retry-After": "5"}) from None
    return Health(status="ready")
