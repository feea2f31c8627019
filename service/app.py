"""The collector's app factory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from quantwatch import __version__
from quantwatch.service import web
from quantwatch.service.alerts.setup import firing_counts, install_alerts
from quantwatch.service.api import problems
from quantwatch.service.api.deps import FiringAlertCounts, ingest_observers_of
from quantwatch.service.api.gate import IngestGate
from quantwatch.service.api.routes import catalog, health, ingest, runs
from quantwatch.service.batch import IngestObserver
from quantwatch.service.core.config import Settings
from quantwatch.service.core.db import WriteHealth, make_engine, make_sessionmaker, upgrade
from quantwatch.service.exposition import StartupRestore, alert_series_source, delivery_counts, install_exposition
from quantwatch.service.ranks.setup import install_ranks
from quantwatch.service.store import RetentionPolicy, Store
from quantwatch.service.sweeper import CompactionSweeper, RetentionSweeper
from quantwatch.service.whatif import routes as whatif_routes
from quantwatch.service.whatif.setup import install_whatif

__all__ = ["FiringAlertCounts", "create_app"]

SHUTDOWN_FOLD_SECONDS = 10.0
"""How long a stopping collector lets the background folder finish the folds already queued (one left over is done
at its rank's next compaction)."""


POSTGRES_INGEST_THREADS = 4
"""Ingest requests stored at once on PostgreSQL when ``ingest_threads`` is unset: every request's Python runs side by
side there (SQLite's group commit queues its writers itself), and past a few threads they only contend for the GIL:
at 64 ranks in a closed loop 4 threads served 1.6 × the requests/s of one thread a request (BENCHMARKS, session 18)."""


def ingest_threads(settings: Settings, store: Store) -> int | None:
    """The ingest requests decoded and stored at once (see ``Settings.ingest_threads``; None: no limit of ours)."""
    if settings.ingest_threads is not None:
        return settings.ingest_threads
    return POSTGRES_INGEST_THREADS if store.pg else None


def create_app(
    settings: Settings | None = None,
    *,
    observers: Sequence[IngestObserver] = (),
    firing_alert_counts: FiringAlertCounts | None = None,
) -> FastAPI:
    """Build the collector: engine, migrations (``settings.auto_upgrade``), store, routes and error handlers.

    ``observers`` see every stored batch (see :class:`IngestObserver`); more can be appended to
    ``app.state.ingest_observers`` before the app serves. ``firing_alert_counts`` maps run names to their firing
    alert count for the run listings (the alerts part provides it).
    """
    settings = settings or Settings()
    engine = make_engine(settings)
    if settings.auto_upgrade:
        upgrade(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        exposition.start()
        sweeper.start()
        compaction.start()
        try:
            yield
        finally:
            compaction.stop()
            sweeper.stop()
            exposition.stop()
            worker.stop()
            store.wait_for_folds(SHUTDOWN_FOLD_SECONDS)

    app = FastAPI(
        lifespan=lifespan,
        title="QuantWatch collector",
        version=__version__,
        description="Ingest and full-resolution history of quantization error during low-precision training.",
    )
    app.state.settings = settings
    app.state.engine = engine
    store = Store(engine, make_sessionmaker(engine), fold_chunks=settings.fold_chunks)
    app.state.store = store
    policy = RetentionPolicy(settings.retention_steps, settings.retention_age)
    sweeper = RetentionSweeper(store, policy, settings.retention_interval_seconds)
    app.state.retention = sweeper
    compaction = CompactionSweeper(store)
    app.state.compaction = compaction
    write_health = WriteHealth()
    app.state.write_health = write_health
    app.state.ingest_observers = list(observers)
    app.state.ingest_gate = IngestGate(settings.max_pending_ingest, ingest_threads(settings, store))
    app.state.firing_alert_counts = firing_alert_counts
    app.state.token_scopes = settings.token_scopes()
    problems.install(app, write_health)
    app.include_router(health.router)
    ingest.install(app)
    install_ranks(app, settings, store)  # before runs: its /runs/{run}/ranks must win over /runs/{run}
    app.include_router(whatif_routes.router)  # before runs, as the ranks' route
    app.include_router(runs.router)
    app.include_router(catalog.router)
    alerts, worker = install_alerts(app, settings, store)
    ingest_observers_of(app).insert(0, alerts)
    ingest_observers_of(app).insert(0, alerts.formats)  # layer formats are recorded before alerts read them
    install_whatif(app, store, alerts)  # first among the observers
    if firing_alert_counts is None:
        app.state.firing_alert_counts = firing_counts(store.factory)
    restore = StartupRestore(store.factory)  # the state of the runs stored before a restart
    exposition = install_exposition(
        app,
        top_k=settings.metrics_top_k,
        run_ttl_seconds=settings.metrics_run_ttl_seconds,
        alerts=alert_series_source(alerts, restore.alert_series),
        deliveries=delivery_counts(store.factory),
        restore=restore,
        retention_dropped=sweeper.dropped_points if policy.enabled else None,
    )
    web.install(app)
    return app
