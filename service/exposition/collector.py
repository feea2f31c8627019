"""The one custom Prometheus collector: the cache, the alert series and the ingest figures as metric families."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from quantwatch import __version__
from quantwatch.service.exposition.alert_states import (
    DELIVERY_STATUSES,
    EXPORTED_ALERT_STATES,
    AlertSeries,
    AlertSeriesSource,
    DeliveryCounts,
    severity_order,
)
from quantwatch.service.exposition.cache import LatestValueCache
from quantwatch.service.exposition.ingest_metrics import IngestMetrics
from quantwatch.service.exposition.naming import run_family_name
from quantwatch.service.exposition.writer import LayerGaugeFamily, RowsGaugeFamily

__all__ = ["QuantWatchCollector"]


class QuantWatchCollector(Collector):
    """The one custom collector: layer and run gauges from the cache, alert streaks and states, cap counters."""

    def __init__(
        self,
        cache: LatestValueCache,
        ingest: IngestMetrics | None = None,
        alerts: AlertSeriesSource | None = None,
        deliveries: DeliveryCounts | None = None,
        retention_dropped: Callable[[], int] | None = None,
    ) -> None:
        """``retention_dropped``: the raw points retention dropped so far (its counter is exported only with it)."""
        self.cache = cache
        self.ingest = ingest if ingest is not None else IngestMetrics()
        self.alerts = alerts
        self.deliveries = deliveries
        self.retention_dropped = retention_dropped

    def collect(self) -> Iterator[Metric]:
        """Yield every family of a scrape, in a stable order."""
        snap = self.cache.snapshot()
        for family in snap.layer_families:
            yield LayerGaugeFamily(
                family, f"Latest {family.metric} of the worst layers of each run (top-K per run and metric)."
            )
        scalars: dict[str, RowsGaugeFamily] = {}
        for run, rank, scalar, value in snap.run_scalars:
            name = run_family_name(scalar)
            if name not in scalars:
                scalars[name] = RowsGaugeFamily(name, f"Latest {scalar} of each run.", ["run", "rank"])
            scalars[name].add([run, str(rank)], value)
        yield from (scalars[name] for name in sorted(scalars))
        yield RowsGaugeFamily(
            "quantwatch_run_last_step",
            "Newest step ingested for each run and rank.",
            ["run", "rank"],
            (([run, str(rank)], step) for run, rank, step in snap.last_steps),
        )
        yield RowsGaugeFamily(
            "quantwatch_run_last_ingest_timestamp_seconds",
            "Unix time of the newest batch ingested for each run.",
            ["run"],
            (([run], seen) for run, seen in snap.last_seen),
        )
        yield RowsGaugeFamily(
            "quantwatch_exposition_layer_series_omitted",
            "Layer series known to the cache but not exported because of the top-K cap, per metric.",
            ["metric"],
            (([metric], count) for metric, count in snap.omitted_series),
        )
        yield CounterMetricFamily(
            "quantwatch_exposition_layer_values_omitted",
            "Latest layer values of ingested batches that the top-K cap left out of the exposition.",
            value=snap.omitted_values_total,
        )
        yield CounterMetricFamily(
            "quantwatch_exposition_runs_expired",
            "Runs dropped from the exposition after sending nothing for the TTL.",
            value=snap.expired_runs_total,
        )
        yield from self._alert_families({run for run, _ in snap.last_seen})
        yield from self.ingest.families()
        if self.retention_dropped is not None:
            yield CounterMetricFamily(
                "quantwatch_retention_dropped_points",
                "Raw points (one value of one series at one step) that retention dropped; their rollups stay.",
                value=self.retention_dropped(),
            )
        yield InfoMetricFamily(
            "quantwatch_build",
            "QuantWatch collector build.",
            value={"version": __version__},
        )

    def _alert_families(self, active_runs: set[str]) -> Iterator[Metric]:
        """Streaks and states of the runs the cache still exports, at most ``top_k`` series per (rule, run): the
        longest streaks, and every pending or firing alert among them first."""
        streaks = RowsGaugeFamily(
            "quantwatch_alert_streak_steps",
            "Consecutive breaching steps of each (rule, run, layer) series with a non-zero streak.",
            ["rule", "run", "layer"],
        )
        states = RowsGaugeFamily(
            "quantwatch_alert_state",
            "1 for each (rule, run, layer) alert that is pending or firing.",
            ["rule", "run", "layer", "state"],
        )
        by_rule_run: dict[tuple[str, str], list[AlertSeries]] = {}
        for alert in self.alerts() if self.alerts is not None else ():
            if alert.run in active_runs:
                by_rule_run.setdefault((alert.rule, alert.run), []).append(alert)
        top_k = self.cache.top_k
        kept = [
            alert
            for group in by_rule_run.values()
            for alert in sorted(group, key=lambda a: severity_order(a.state, a.streak_steps, a.layer))[:top_k]
        ]
        for alert in sorted(kept, key=lambda a: (a.rule, a.run, a.layer)):
            if alert.streak_steps > 0:
                streaks.add([alert.rule, alert.run, alert.layer], alert.streak_steps)
            if alert.state in EXPORTED_ALERT_STATES:
                states.add([alert.rule, alert.run, alert.layer, alert.state], 1)
        yield streaks
        yield states
        if self.deliveries is not None:
            counts = self.deliveries()
            yield RowsGaugeFamily(
                "quantwatch_alert_deliveries",
                "Alert notifications in the outbox by status (pending, delivered, failed, cancelled).",
                ["status"],
                (([status], counts.get(status, 0)) for status in DELIVERY_STATUSES),
            )
