"""The background thread that folds raw points into chunks (issue 21; :mod:`.folding` says how a fold is safe).

A compaction that moved a rank's frontier queues the rank (:meth:`FoldWorker.request`, a set insertion: the batch
that set it off returns at once). One daemon thread per store takes the queued ranks in order: for each it plans the
folds in a short read transaction, encodes their chunks with no transaction open (on SQLite an open read would hold
the write-ahead log from being checkpointed back to its start), then applies them under the rank's write lock: on
SQLite as one member of an ingest group (:mod:`.group_commit`: its own savepoint, committed with the group's
batches, so it costs no commit of its own and the group pipeline does not stop for it), on PostgreSQL in a short
transaction of its own under the rank's advisory lock. The
encoding, most of a fold's CPU, runs in a process of its own (:mod:`.chunk_encoder`) once a rank's fold encodes at
least :data:`PROCESS_VALUES` values.

The thread ends after :data:`IDLE_SECONDS` with nothing queued (the process with it) and starts again with the next
request, so an idle store holds neither. On PostgreSQL the worker vacuums the raw points' table every
:data:`VACUUM_BYTES` of rows its folds deleted, so the table keeps the size of the raw tail. A fold that fails is
logged; the rank's next compaction queues it again, and the fold then takes everything due, the rows left behind
included.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import Connection, select, text
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Run, RunRank
from quantwatch.service.store.chunk_encoder import EncoderProcess
from quantwatch.service.store.folding import ChunkFolder, Encoder, SeriesFold, encode_chunks, encode_folds
from quantwatch.service.store.group_commit import GroupCommit
from quantwatch.service.store.raw_points import Rows

log = logging.getLogger("quantwatch.service")

IDLE_SECONDS = 60.0
"""How long the thread waits for more work before it ends (its encoding process with it). Longer than the gaps
between folds a busy collector sees (at the agent's cadence each rank compacts every 256 steps, about 10 sampled steps
or 20 s, so 16 ranks posting every 2 s queue a fold about every 1.3 s): starting the process costs about 0.8 s of
CPU."""
VACUUM_BYTES = 1 << 20
"""Bytes of raw rows folds delete on PostgreSQL between two vacuums of their table (see FoldWorker._vacuum_after).
Less than one fold of a wide rank (128 steps × 512 layers × 12 metrics: 3 MiB), so such a fold's rows are free for
the next ones at once: at 4 MiB the table held the rows of two folds besides the tail, 1.38 → 0.83 bytes per point of
raw table at 1,024 steps (bench/storage_layout.py, demo, 16-step batches); the vacuums took
328 ms of the 11 s its 63 folds took at 4,096 steps (98 ms at 4 MiB)."""
PROCESS_VALUES = 1 << 17
"""Values a rank's fold encodes from which the encoding goes to the worker's process (fewer: on its thread, as the
round trip's pickling costs more than it saves; 64 steps × 512 layers × 4 metrics is 131,072)."""


class FoldWorker:
    """Folds the ranks queued by compaction on a thread of its own (see the module's docstring)."""

    def __init__(self, factory: sessionmaker[Session], group: GroupCommit | None) -> None:
        """``group``: the SQLite writers' group commit, whose transactions the applies join (None: PostgreSQL, where
        an apply runs in a transaction of its own under the rank's advisory lock)."""
        self.factory = factory
        self.pg = group is None
        self.folder = ChunkFolder()
        self._group = group
        self._changed = threading.Condition()
        self._queue: dict[tuple[int, int], int] = {}
        self._busy = False
        self._thread: threading.Thread | None = None
        self._deleted_bytes = 0

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

    def fold(self, run_id: int, rank: int, lock_key: int, encode: Encoder = encode_chunks) -> int:
        """Fold what is due of (run, rank) now, in the calling thread, its chunks encoded by ``encode``; return the
        series folded (a series whose rows changed between the plan and the apply is left for the next fold)."""
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
            session.rollback()  # before the encoding (see the module)
        if not folds:
            return 0
        encode_folds(folds, encode)
        if self._group is not None:
            applied = self._group.run(lambda session: self._apply(session.connection(), folds))
        else:
            with self.factory() as session:
                try:
                    conn = session.connection()
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key})
                    applied = self._apply(conn, folds)
                    session.commit()
                except BaseException:
                    session.rollback()
                    raise
        if self.pg:
            self._vacuum_after(sum(len(f.seen.raw) * int(row[1]) * 4 for f in applied))
        return len(applied)

    def _apply(self, conn: Connection, folds: list[SeriesFold]) -> list[SeriesFold]:
        return [fold for fold in folds if self.folder.apply(conn, fold)]

    def _vacuum_after(self, deleted_bytes: int) -> None:
        """On PostgreSQL, VACUUM the raw points' table once folds deleted :data:`VACUUM_BYTES` of its rows since the
        last: the deleted rows are dead tuples until a vacuum makes their space reusable, and autovacuum, which looks
        once a minute, lets the raw tail's table grow by a minute of ingest meanwhile."""
        with self._changed:
            self._deleted_bytes += deleted_bytes
            due = self._deleted_bytes >= VACUUM_BYTES
            if due:
                self._deleted_bytes = 0
        if due:
            with self.factory() as session:
                conn = session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
                conn.exec_driver_sql("VACUUM points")

    def _loop(self) -> None:
        encoder = _Encoder()
        while True:
            with self._changed:
                if not self._changed.wait_for(lambda: self._queue, IDLE_SECONDS):
                    self._thread = None
                    break
                (run_id, rank), lock_key = next(iter(self._queue.items()))
                del self._queue[(run_id, rank)]
                self._busy = True
            try:
                self.fold(run_id, rank, lock_key, encoder)
            except Exception:
                log.exception("folding run id %d rank %d failed; its next compaction retries it", run_id, rank)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
        encoder.close()


class _Encoder:
    """Encodes on the calling thread below :data:`PROCESS_VALUES` values, else in an :class:`EncoderProcess` started
    on first use (one thread's)."""

    def __init__(self) -> None:
        self._process: EncoderProcess | None = None

    def __call__(self, parts: list[Rows]) -> list[dict[str, object]]:
        if sum(rows.values.size for rows in parts) < PROCESS_VALUES:
            return encode_chunks(parts)
        if self._process is None:
            self._process = EncoderProcess()
        try:
            return self._process.encode(parts)
        except BaseException:
            self.close()  # it died, or the pipe holds half an answer: the next fold starts another
            raise

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None
