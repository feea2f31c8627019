"""All database access of the collector behind one facade, :class:`Store`: ingest (``writes``, with ``rollup_writes``),
history reads (``reads``: a Store is a ``HistoryReader``), export (``export``), the what-if statistics (``whatif``),
retention (``retention``) and the health probe.

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
from quantwatch.service.store.retention import Retention, RetentionPass, RetentionPolicy
from quantwatch.service.store.whatif import WhatIfStore
from quantwatch.service.store.writes import BatchWriter

__all__ = ["IngestResult", "NotFoundError", "RetentionPass", "RetentionPolicy", "Store", "choose_width"]


class Store(HistoryReader):
    """Data access for one engine over one session factory: the history reads themselves (:class:`HistoryReader`),
    ingest through the writer and export through the exporter."""

    EXPORT_COLUMNS = EXPORT_COLUMNS

    def __init__(self, engine: Engine, factory: sessionmaker[Session], *, fold_chunks: bool = True) -> None:
        """``fold_chunks``: raw points behind the compaction frontier are folded into chunks by a background thread
        (the setting of that name); reads merge the chunks stored either way."""
        super().__init__(engine, factory)
        self.pg = engine.dialect.name == "postgresql"
        self._writer = BatchWriter(engine, factory, fold_chunks=fold_chunks)
        self._exporter = Exporter(factory)
        self._retention = Retention(
            factory, self.pg, self._writer._exclusive, BatchWriter.rank_key, self._writer._rollups
        )
        self.whatif = WhatIfStore(factory)
        """The what-if statistics' reads."""

    @staticmethod
    def _rank_key(run_id: int, rank: int) -> int:
        """The PostgreSQL advisory lock key that serialises the writers of one (run, rank)."""
        return BatchWriter.rank_key(run_id, rank)

    def ingest(self, batch: IngestBatch, observers: Sequence[IngestObserver] = ()) -> IngestResult:
        """Store ``batch`` atomically, or recognise it as a duplicate; run the observers (see IngestObserver)."""
        return self._writer.ingest(batch, observers)

    def compact_rollups(self, run: str) -> None:
        """Move each rank's frontier of ``run`` past its last step now: build its base blocks, the partial last one
        included, and the complete blocks above them, and, with folding on, fold what is due of its raw points into
        chunks before it returns (raises NotFoundError). Ingest builds blocks up to edges of 64 or 256 steps (the
        compaction sweeper those of ranks that stopped sending); this is for a downgrade below migration 0007 (whose
        downgrade refuses ranks with steps past their frontier) and for tests."""
        self._writer.compact_all(run)

    def compact_idle(self, seen_before: float) -> int:
        """Build the complete blocks of every rank that has some not built and whose last batch came before
        ``seen_before`` (seconds since the epoch): ingest compacts a rank up to edges of several blocks only, so a rank
        that stopped sending is compacted here (by the collector's compaction sweeper); how many ranks it compacted."""
        return self._writer.compact_idle(seen_before)

    def wait_for_folds(self, timeout: float | None = None) -> bool:
        """Wait until the background folder has folded every rank queued so far (at once with folding off); False
        when ``timeout`` ran out first."""
        folds = self._writer._compactor.folds
        return True if folds is None else folds.wait_idle(timeout)

    def sweep_retention(self, policy: RetentionPolicy, now: float, *, max_ranks: int | None = None) -> RetentionPass:
        """Drop the raw points ``policy`` makes due at time ``now`` (seconds since the epoch), their rollups kept: one
        transaction per (run, rank), at most ``max_ranks`` of them (the next sweep carries on after the last one)."""
        return self._retention.sweep(policy, now, max_ranks=max_ranks)

    def delete_run(self, name: str) -> None:
        """Delete a run and everything stored for it (foreign keys cascade)."""
        self._writer.delete_run(name)

    def list_actions(self, name: str) -> list[dict[str, Any]]:
        """The actions the agent took on run ``name``, by step (raises NotFoundError)."""
        return list_actions(self.factory, name)

    def export_csv(self, run: str) -> Iterator[bytes]:
        """CSV of every stored point (header first); float32 values printed exactly (round-trip)."""
        return self._exporter.export_csv(run)

    def export_parquet(self, run: str) -> Iterator[bytes]:
        """Parquet of every stored point, written and streamed one row group per chunk (needs pyarrow)."""
        return self._exporter.export_parquet(run)
