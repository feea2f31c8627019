"""Wiring of the alerting part into the collector app: rules sync, the ingest observer, the worker, the routes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.alerts import repository
from quantwatch.service.alerts.catalog import sync_rules_file
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.outbox import DeliveryWorker, RetryPolicy
from quantwatch.service.alerts.rules import load_rules_file
from quantwatch.service.api.routes import alerts, receivers, rules
from quantwatch.service.core.config import Settings
from quantwatch.service.core.db import write_session
from quantwatch.service.store import Store

__all__ = ["firing_counts", "install_alerts"]


def install_alerts(app: FastAPI, settings: Settings, store: Store) -> tuple[AlertEngine, DeliveryWorker]:
    """Sync the rules file (or the defaults) into the database, mount the routes, build engine and worker.

    The caller registers the engine as an ingest observer and starts/stops the worker with the app's lifespan.
    Raises :class:`~quantwatch.service.alerts.rules.RulesFileError` (with line numbers) for a bad rules file.
    """
    rules_file = load_rules_file(str(settings.rules_file)) if settings.rules_file is not None else None
    worker = DeliveryWorker(
        store.factory,
        policy=RetryPolicy(
            base_seconds=settings.alert_retry_base_seconds, max_seconds=settings.alert_retry_max_seconds
        ),
    )
    engine = AlertEngine(
        external_url=settings.external_url or f"http://{settings.host}:{settings.port}",
        delivery_horizon_seconds=settings.alert_delivery_horizon_seconds,
        wake=worker.wake,
        dispatch=worker.dispatch,
        states_ttl_seconds=settings.metrics_run_ttl_seconds,
    )
    with write_session(store.factory) as session:
        sync_rules_file(session, engine, rules_file)
    app.state.alerts = engine
    app.state.delivery_worker = worker
    for module in (rules, receivers, alerts):
        app.include_router(module.router)
    return engine, worker


def firing_counts(sessions: sessionmaker[Session]) -> Callable[[Sequence[str]], Mapping[str, int]]:
    """A function mapping run names to their number of firing episodes (for the run listings)."""

    def count(runs: Sequence[str]) -> Mapping[str, int]:
        if not runs:
            return {}
        with sessions() as session:
            return repository.firing_episode_counts(session, runs)

    return count
