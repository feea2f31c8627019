"""Prometheus exposition of the collector: a latest-value cache, one custom collector, and ``GET /metrics``.

Layers import downward, as in prometheus/client_python (metric → registry → exposition):

* :mod:`.naming` — family names (from the protocol's catalogue) and the text format's spelling of labels;
* :mod:`.cache` — the :class:`LatestValueCache`, which knows nothing of Prometheus beyond the names it renders;
* :mod:`.renderer` — the :class:`BackgroundRenderer` that renders changed slots between scrapes;
* :mod:`.writer` — gauge families that write their own lines and :func:`render_exposition`;
* :mod:`.alert_states` and :mod:`.ingest_metrics` — the alert series and the ingest figures;
* :mod:`.collector` — :class:`QuantWatchCollector`, everything above as metric families on the app's own registry;
* :mod:`.queries` — the package's reads from the database; :mod:`.restore` — the state rebuilt from it at start;
* :mod:`.observer`, :mod:`.middleware`, :mod:`.route` — the wiring into the app and ``GET /metrics``.
"""

from quantwatch.service.exposition.alert_states import (
    AlertSeries,
    AlertSeriesSource,
    DeliveryCounts,
    alert_series_source,
)
from quantwatch.service.exposition.cache import (
    DEFAULT_RUN_TTL_SECONDS,
    DEFAULT_TOP_K,
    LatestValueCache,
    StepLike,
    StepValues,
)
from quantwatch.service.exposition.collector import QuantWatchCollector
from quantwatch.service.exposition.ingest_metrics import IngestMetrics
from quantwatch.service.exposition.middleware import IngestTimingMiddleware
from quantwatch.service.exposition.naming import (
    LAYER_METRIC_FAMILIES,
    RUN_SCALAR_FAMILIES,
    layer_family_name,
    run_family_name,
)
from quantwatch.service.exposition.observer import PrometheusObserver
from quantwatch.service.exposition.queries import RestoreLimits, delivery_counts
from quantwatch.service.exposition.renderer import (
    DEFAULT_RENDER_IDLE_AFTER_SECONDS,
    DEFAULT_RENDER_INTERVAL_SECONDS,
    BackgroundRenderer,
)
from quantwatch.service.exposition.restore import StartupRestore
from quantwatch.service.exposition.route import Exposition, install_exposition
from quantwatch.service.exposition.writer import CONTENT_TYPE, render_exposition

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_RENDER_IDLE_AFTER_SECONDS",
    "DEFAULT_RENDER_INTERVAL_SECONDS",
    "DEFAULT_RUN_TTL_SECONDS",
    "DEFAULT_TOP_K",
    "LAYER_METRIC_FAMILIES",
    "RUN_SCALAR_FAMILIES",
    "AlertSeries",
    "AlertSeriesSource",
    "BackgroundRenderer",
    "DeliveryCounts",
    "Exposition",
    "IngestMetrics",
    "IngestTimingMiddleware",
    "LatestValueCache",
    "PrometheusObserver",
    "QuantWatchCollector",
    "RestoreLimits",
    "StartupRestore",
    "StepLike",
    "StepValues",
    "alert_series_source",
    "delivery_counts",
    "install_exposition",
    "layer_family_name",
    "render_exposition",
    "run_family_name",
]
