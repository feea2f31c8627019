"""Mounting the what-if statistics on the collector: their ingest observer, routes and the alerts' remediation."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from sqlalchemy.orm import Session

from quantwatch.service.alerts.engine import AlertEngine, RemedyKey
from quantwatch.service.api.deps import ingest_observers_of
from quantwatch.service.store import Store
from quantwatch.service.store.common import NotFoundError, find_run
from quantwatch.service.store.whatif import WhatIfRecorder
from quantwatch.service.whatif.advice import DEFAULT_BUDGET, DEFAULT_WINDOW, parse_budget, remediation

__all__ = ["install_whatif"]


def install_whatif(app: FastAPI, store: Store, alerts: AlertEngine) -> None:
    """Store what-if entries first among the ingest observers (the alerts' remediation reads the batch's own) and
    give the alert engine its remediation (the routes, :mod:`~quantwatch.service.whatif.routes`, are mounted by
    ``create_app`` before the runs' router, whose ``/runs/{run}`` would take their paths)."""
    ingest_observers_of(app).insert(0, WhatIfRecorder())
    budget = parse_budget(str(DEFAULT_BUDGET))

    def remedy(session: Session, run: str, keys: Sequence[RemedyKey]) -> dict[RemedyKey, str | None]:
        wanted = [(layer, rank) for layer, rank in keys if layer]
        if not wanted:
            return {}
        try:
            run_id = find_run(session, run).id
        except NotFoundError:
            return {}
        texts: dict[RemedyKey, str | None] = {}
        for rank in sorted({rank for _, rank in wanted}):
            if not store.whatif.has_entries(session, run_id, rank):
                continue  # one lookup for a rank without what-if statistics, not two per layer
            for layer in (layer for layer, of in wanted if of == rank):
                _, rows = store.whatif.window_in(session, run_id, rank, DEFAULT_WINDOW, layer)
                if rows:
                    texts[(layer, rank)] = remediation(layer, rows, budget, DEFAULT_WINDOW)
        return texts

    alerts.remediation = remedy
