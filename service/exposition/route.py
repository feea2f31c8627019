"""``GET /metrics``: the exposition parts of one app, wired together and mounted."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry

from quantwatch.service.api.deps import ReadAuth, ingest_observers_of
from quantwatch.service.exposition.alert_states import AlertSeriesSource, DeliveryCounts
from quantwatch.service.exposition.cache import DEFAULT_RUN_TTL_SECONDS, DEFAULT_TOP_K, LatestValueCache
from quantwatch.service.exposition.collector import QuantWatchCollector
from quantwatch.service.exposition.ingest_metrics import IngestMetrics
from quantwatch.service.exposition.middleware import IngestTimingMiddleware
from quantwatch.service.exposition.observer import PrometheusObserver
from quantwatch.service.exposition.renderer import DEFAULT_RENDER_INTERVAL_SECONDS, BackgroundRenderer
from quantwatch.service.exposition.restore import StartupRestore
from quantwatch.service.exposition.writer import CONTENT_TYPE, render_exposition

__all__ = ["Exposition", "install_exposition"]


@dataclass(frozen=True)
class Exposition:
    """The exposition parts of one app: its own registry, the cache, the ingest figures and the collector."""

    registry: CollectorRegistry
    cache: LatestValueCache
    ingest: IngestMetrics
    collector: QuantWatchCollector
    renderer: BackgroundRenderer
    restore: StartupRestore | None = None

    def render(self) -> bytes:
        """The text exposition of the app's registry."""
        return render_exposition(self.registry)

    def start(self) -> None:
        """Start the background parts (the app's lifespan does): the renderer, and the restore if there is one."""
        if self.restore is not None:
            self.restore.start(self.cache)
        self.renderer.start()

    def stop(self) -> None:
        """Stop the background parts."""
        self.renderer.stop()
        if self.restore is not None:
            self.restore.stop()


def install_exposition(
    app: FastAPI,
    *,
    top_k: int = DEFAULT_TOP_K,
    run_ttl_seconds: float = DEFAULT_RUN_TTL_SECONDS,
    alerts: AlertSeriesSource | None = None,
    deliveries: DeliveryCounts | None = None,
    clock: Callable[[], float] = time.time,
    render_interval_seconds: float = DEFAULT_RENDER_INTERVAL_SECONDS,
    restore: StartupRestore | None = None,
    retention_dropped: Callable[[], int] | None = None,
) -> Exposition:
    """Give ``app`` its ``GET /metrics``: a registry of its own, the cache as an ingest observer, ingest timing.

    The app's lifespan starts and stops the exposition's background parts (:meth:`Exposition.start`): the renderer,
    and ``restore``, which rebuilds the cache from the database (its ``alert_series`` belong in ``alerts``).
    ``retention_dropped`` gives the retention counter (exported only when given: retention is on).
    """
    cache = LatestValueCache(top_k=top_k, run_ttl_seconds=run_ttl_seconds, clock=clock)
    ingest = IngestMetrics()
    collector = QuantWatchCollector(cache, ingest, alerts, deliveries, retention_dropped)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    renderer = BackgroundRenderer(cache, render_interval_seconds)
    exposition = Exposition(registry, cache, ingest, collector, renderer, restore)
    app.state.exposition = exposition
    ingest_observers_of(app).append(PrometheusObserver(cache, ingest))
    app.add_middleware(IngestTimingMiddleware, metrics=ingest)

    @app.get(
        "/metrics",
        tags=["health"],
        response_class=Response,
        dependencies=[ReadAuth],
        responses={
            200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format 0.0.4"},
            401: {"description": "Missing or unknown bearer token (when tokens are configured)"},
            403: {"description": "The token lacks the read scope"},
        },
    )
    def metrics() -> Response:
        """Prometheus exposition: latest values of the worst layers per run and metric, run scalars, alert
        streaks and states, ingest counters and latency. Needs a read-scope token when tokens are configured
        (Prometheus sends it with ``authorization: credentials_file``)."""
        return Response(exposition.render(), media_type=CONTENT_TYPE)

    return exposition
