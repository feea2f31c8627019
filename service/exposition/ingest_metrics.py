"""Request-level figures of the ingest path (points, requests by outcome, latency), as metric families."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from quantwatch.service.exposition.naming import go_float

__all__ = ["IngestMetrics"]


class IngestMetrics:
    """Request-level figures of the ingest path: a few additions per request under a lock, never work per point.

    Kept as plain numbers rather than prometheus_client instruments so that the exposition carries no ``_created``
    samples and is byte-for-byte reproducible under a frozen clock.
    """

    OUTCOMES = ("accepted", "duplicate", "rejected", "throttled", "error")
    DURATION_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.points_total = 0
        self.requests_total = dict.fromkeys(self.OUTCOMES, 0)
        self._bucket_counts = [0] * (len(self.DURATION_BUCKETS_SECONDS) + 1)
        self._duration_sum_seconds = 0.0

    def observe_points(self, points: int) -> None:
        """Count points stored by one committed batch."""
        with self._lock:
            self.points_total += points

    def observe_request(self, status_code: int, seconds: float, *, duplicate: bool = False) -> None:
        """Count one answered ingest request by outcome and record its latency."""
        if status_code < 300:
            outcome = "duplicate" if duplicate else "accepted"
        elif status_code in (429, 503):
            outcome = "throttled"
        elif status_code < 500:
            outcome = "rejected"
        else:
            outcome = "error"
        with self._lock:
            self.requests_total[outcome] += 1
            self._bucket_counts[bisect.bisect_left(self.DURATION_BUCKETS_SECONDS, seconds)] += 1
            self._duration_sum_seconds += seconds

    def families(self) -> Iterator[Metric]:
        """The ingest counters and the latency histogram as metric families."""
        with self._lock:
            points = self.points_total
            requests = dict(self.requests_total)
            counts = list(self._bucket_counts)
            total_seconds = self._duration_sum_seconds
        yield CounterMetricFamily(
            "quantwatch_ingest_points", "Points stored by ingest (one value of one series at one step).", value=points
        )
        by_outcome = CounterMetricFamily(
            "quantwatch_ingest_requests",
            "Ingest requests by outcome: accepted, duplicate, rejected (4xx), throttled (429/503), error (5xx).",
            labels=["outcome"],
        )
        for outcome in self.OUTCOMES:
            by_outcome.add_metric([outcome], requests[outcome])
        yield by_outcome
        cumulative = list(itertools.accumulate(counts))
        bounds = [go_float(b) for b in self.DURATION_BUCKETS_SECONDS] + ["+Inf"]
        yield HistogramMetricFamily(
            "quantwatch_ingest_request_duration_seconds",
            "Time to answer an ingest request.",
            buckets=list(zip(bounds, cumulative, strict=True)),
            sum_value=total_seconds,
        )
