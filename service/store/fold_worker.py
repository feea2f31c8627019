"""The background thread that folds raw points into chunks (issue 21; :mod:`.folding` says how a fold is safe).

A compaction that moved a rank's frontier queues the rank (:meth:`FoldWorker.request`, a set insertion: the batch
that set it off returns at once). One daemon thread per store takes the queued ranks in order: for each it plans the
folds in a read transaction of its own, with no write lock held while it encodes, then applies them in one short
transaction under the rank's write lock (SQLite: the writer's slot between ingest groups; PostgreSQL: the rank's
advisory lock). The thread ends after :data:`IDLE_SECONDS` with nothing queued and starts again with the next
request, so an idle store holds no thread. A fold that fails is logged; the rank's next compaction queues it again,
and the fold then takes everything due, the rows left behind included.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Run, RunRank
from quantwatch.service.store.folding import ChunkFolder

log = logging.getLogger("quantwatch.service")

IDLE_SECONDS = 2.0
"""How long the thread waits for more work before it ends."""


class FoldWorker:
    """Folds the ranks queued by compaction on a thread of its own (see the module's docstring)."""

    def __init__(
        self, factory: sessionmaker[Session], pg: bool, exclusive: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.factory = factory
        self.pg = pg
        self.folder = ChunkFolder()
        self._exclusive = exclusive
        self._changed = threading.Condition()
        self._queue: dict[tuple[int, int], int] = {}
        self._busy = False
        self._thread: threading.Thread | None = None

    def request(self, run_id: int, rank: int, lock_key: int) -> None:
        """Queue (run, rank) for a fold (``lock_key``: its PostgreSQL advisory lock); start the thread if it is not
        running."""
        with self._changed:
            self._queue[(run_id, rank)] = lock_key
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="quantwatch-fold", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every rank queued so far is folded (or its fold failed); False when ``timeout`` ran out."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._busy, timeout)

    def fold(self, run_id: int, rank: int, lock_key: int) -> int:
        """Fold what is due of (run, rank) now, in the calling thread; return the series folded (a series whose rows
        changed between the plan and the apply is left for the next fold)."""
        with self.factory() as session:
            conn = session.connection()
            row = conn.execute(
                select(RunRank.compacted_step, Run.layer_count)
                .join(Run, Run.id == RunRank.run_id)
                .where(RunRank.run_id == run_id, RunRank.rank == rank)
            ).first()
            if row is None:  # the run was deleted meanwhile
                return 0
            folds = self.folder.plan(conn, run_id, rank, int(row[0]), int(row[1]))
            session.rollback()
        if not folds:
            return 0
        with self._exclusive(), self.factory() as session:
            conn = session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            try:
                if self.pg:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key})
                applied = sum(self.folder.apply(conn, f) for f in folds)
                session.commit()
            except BaseException:
                session.rollback()
                raise
        return applied

    def _loop(self) -> None:
        while True:
            with self._changed:
                if not self._changed.wait_for(lambda: self._queue, IDLE_SECONDS):
                    self._thread = None
                    return
                (run_id, rank), lock_key = next(iter(self._queue.items()))
                del self._queue[(run_id, rank)]
                self._busy = True
            try:
                self.fold(run_id, rank, lock_key)
            except Exception:
                log.exception("folding run id %d rank %d failed; its next compaction retries it", run_id, rank)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
