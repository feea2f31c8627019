"""All database access of the collector behind one facade, :class:`Store`: ingest (``writes``, with ``rollup_writes``),
history reads (``reads``), export (``export``) and the health probe.

See README "Storage" for the layout. Callers hold a ``Store``; the modules behind it are private.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.batch import IngestBatch, IngestObserver
from quantwatch.service.store.actions import list_actions
from quantwatch.service.store.common import IngestResult, NotFoundError, choose_width
from quantwatch.service.store.export import EXPORT_COLUMNS, Exporter
from quantwatch.service.store.reads import HistoryReader
from quantwatch.service.store.writes import BatchWriter

__all__ = ["IngestResult", "NotFoundError", "Store", "choose_width"]


class Store:
    """Data access for one engine: the writer, the reader and the exporter over one session factory."""

    EXPORT_COLUMNS = EXPORT_COLUMNS

    def __init__(self, engine: Engine, factory: sessionmaker[Session]) -> None:
        self.engine = engine
        self.factory = factory
        self.pg = engine.dialect.name == "postgresql"
        self._writer = BatchWriter(engine, factory)
        self._reader = HistoryReader(engine, factory)
        self._exporter = Exporter(factory)

    @staticmethod
    def _rank_key(run_id: int, rank: int) -> int:
        """The PostgreSQL advisory lock key that serialises the writers of one (run, rank)."""
        return BatchWriter.rank_key(run_id, rank)

    def ingest(self, batch: IngestBatch, observers: Sequence[IngestObserver] = ()) -> IngestResult:
        """Store ``batch`` atomically, or recognise it as a duplicate; run the observers (see IngestObserver)."""
        return self._writer.ingest(batch, observers)

    def compact_rollups(self, run: str) -> None:
        """Build every rollup block of ``run`` now, each rank's partial last block included (raises NotFoundError).
        Ingest builds blocks once they are complete; this is for a downgrade below migration 0004 and for tests."""
        self._writer.compact_all(run)

    def delete_run(self, name: str) -> None:
        """Delete a run and everything stored for it (foreign keys cascade)."""
        self._writer.delete_run(name)

    def list_runs(self) -> list[dict[str, Any]]:
        """Summaries of every run, by name."""
        return self._reader.list_runs()

    def get_run(self, name: str) -> dict[str, Any]:
        """Summary of one run (raises NotFoundError)."""
        return self._reader.get_run(name)

    def run_id(self, name: str) -> int:
        """The database id of run ``name`` (raises NotFoundError)."""
        return self._reader.run_id(name)

    def list_actions(self, name: str) -> list[dict[str, Any]]:
        """The actions the agent took on run ``name``, by step (raises NotFoundError)."""
        return list_actions(self.factory, name)

    def list_layers(self, name: str) -> list[dict[str, Any]]:
        """Layers of a run in model order."""
        return self._reader.list_layers(name)

    def series(
        self, run: str, metric: str, layer: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> dict[str, Any]:
        """min/mean/max of one layer's metric over [start, end]: exact when the range holds ≤ max_points samples."""
        return self._reader.series(run, metric, layer, rank, start, end, max_points)

    def scalar_series(
        self, run: str, scalar: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> dict[str, Any]:
        """The same as :meth:`series` for a per-run scalar (float64, from raw rows)."""
        return self._reader.scalar_series(run, scalar, rank, start, end, max_points)

    def heatmap(
        self,
        run: str,
        metric: str,
        rank: int,
        start: int | None,
        end: int | None,
        max_steps: int,
        layers: str | None,
        agg: str,
    ) -> dict[str, Any]:
        """Layers (model order) × aligned step buckets of ``metric``, aggregated by ``agg`` (max, mean or min)."""
        return self._reader.heatmap(run, metric, rank, start, end, max_steps, layers, agg)

    def export_csv(self, run: str) -> Iterator[bytes]:
        """CSV of every stored point (header first); float32 values printed exactly (round-trip)."""
        return self._exporter.export_csv(run)

    def export_parquet(self, run: str) -> Iterator[bytes]:
        """Parquet of every stored point, written and streamed one row group per chunk (needs pyarrow)."""
        return self._exporter.export_parquet(run)
