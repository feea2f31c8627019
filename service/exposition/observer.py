"""The ingest observer that feeds the exposition after each commit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantwatch.service.exposition.cache import LatestValueCache
from quantwatch.service.exposition.ingest_metrics import IngestMetrics

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from quantwatch.service.batch import IngestBatch, StoredRun

__all__ = ["PrometheusObserver"]


class PrometheusObserver:
    """The ingest observer that feeds the exposition: latest values and the points counter, after commit.

    Nothing happens inside the ingest transaction, so the exposition only ever shows committed data.
    """

    def __init__(self, cache: LatestValueCache, ingest: IngestMetrics) -> None:
        self.cache = cache
        self.ingest = ingest

    def on_batch(self, session: Session, run_row: StoredRun, batch: IngestBatch) -> None:
        """Nothing to do inside the transaction."""

    def after_commit(self, batch: IngestBatch) -> None:
        """Take the committed batch's latest values and count its points."""
        self.cache.observe(batch.run, batch.rank, batch.layers, batch.steps)
        self.ingest.observe_points(batch.points)
