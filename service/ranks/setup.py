"""Mounting the cross-rank checks on the collector."""

from __future__ import annotations

from fastapi import FastAPI

from quantwatch.service.api.deps import ingest_observers_of
from quantwatch.service.core.config import Settings
from quantwatch.service.ranks import routes
from quantwatch.service.ranks.checks import RankChecks
from quantwatch.service.store import Store

__all__ = ["install_ranks"]


def install_ranks(app: FastAPI, settings: Settings, store: Store) -> RankChecks:
    """Register the checks as an ingest observer (last, so they see every observer's committed work) and mount
    the route. The comparisons' synthetic batches go through the app's ingest observers as they are then."""
    observers = ingest_observers_of(app)
    checks = RankChecks(store, lambda: tuple(observers), wait_seconds=settings.rank_compare_wait_seconds)
    app.state.rank_checks = checks
    observers.append(checks)
    app.include_router(routes.router)
    return checks
