"""Checks across the ranks of a run: master weights that must agree within a data-parallel replica group
(``rank_weight_mismatch``) and the environment each rank reports (``GET /api/v1/runs/{run}/ranks``)."""

from __future__ import annotations

from fastapi import FastAPI

from quantwatch.service.core.config import Settings
from quantwatch.service.ranks.checks import RankChecks
from quantwatch.service.store import Store

__all__ = ["RankChecks", "install_ranks"]


def install_ranks(app: FastAPI, settings: Settings, store: Store) -> RankChecks:
    """Register the checks as an ingest observer (last, so they see every observer's committed work) and mount
    the route. The comparisons' synthetic batches go through ``app.state.ingest_observers`` as they are then."""
    from quantwatch.service.ranks import routes  # the routes import the checks: mounted here, not at import

    checks = RankChecks(
        store, lambda: tuple(app.state.ingest_observers), wait_seconds=settings.rank_compare_wait_seconds
    )
    app.state.rank_checks = checks
    app.state.ingest_observers.append(checks)
    app.include_router(routes.router)
    return checks
