"""Liveness and readiness probes (no token needed: orchestrators call them)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from quantwatch.service.api.deps import StoreDep, WriteHealthDep
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.core.db import probe_writes
from quantwatch.service.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"description": "The database cannot take writes (disk full, read-only, locked, unreachable)"}},
)
async def readyz(store: StoreDep, health: WriteHealthDep) -> Health:
    """The database takes writes: a write probe rolled back (see ``probe_writes``) passes and no ingest failed to
    store within the last ``WriteHealth.hold_seconds``; otherwise 503 naming the cause."""
    problem = await run_in_threadpool(probe_writes, store.engine) or health.current()
    if problem is not None:
        raise ProblemError(503, f"not ready: {problem.detail}", headers={"Retry-After": "5"})
    return Health(status="ready")
