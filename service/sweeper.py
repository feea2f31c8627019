"""The collector's sweeps off the ingest path (issue 21): retention, a daemon thread that applies the retention policy,
and compaction, one that builds the blocks of ranks that stopped sending.

Every ``interval_seconds`` it runs sweeps of :data:`RANKS_PER_SWEEP` (run, rank)s each (:meth:`Store.sweep_retention`:
one short transaction per rank) until one finds nothing more to drop, so a backlog drains between two waits without
any one transaction holding a rank's write lock for long. Replicas on one database may all sweep: the store's
transactions make the second sweep of a rank find nothing due.

Ingest compacts a rank up to edges of one or, for sparse sampling, several base blocks
(``store.compaction.edge_steps``); the compaction sweeper compacts, every
:data:`~quantwatch.service.store.compaction.IDLE_SECONDS`, the ranks whose complete blocks wait behind no such edge
and that sent nothing for as long, so their raw points are folded and their blocks built although no batch of
theirs comes to do it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from quantwatch.service.periodic import PeriodicThread, positive_seconds
from quantwatch.service.store import RetentionPolicy, Store
from quantwatch.service.store.compaction import IDLE_SECONDS

__all__ = ["RANKS_PER_SWEEP", "CompactionSweeper", "RetentionSweeper"]

RANKS_PER_SWEEP = 64
"""(run, rank)s one sweep visits before the sweeper looks whether it should stop."""

log = logging.getLogger("quantwatch.service")


class RetentionSweeper(PeriodicThread):
    """Applies ``policy`` to ``store`` every ``interval_seconds``; ``dropped_points_total`` counts what it dropped
    (the ``quantwatch_retention_dropped_points_total`` counter)."""

    def __init__(
        self,
        store: Store,
        policy: RetentionPolicy,
        interval_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__("quantwatch-retention", positive_seconds("retention_interval_seconds", interval_seconds))
        self.store = store
        self.policy = policy
        self.dropped_points_total = 0
        self._clock = clock
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread (idempotent; nothing when the policy drops nothing)."""
        if self.policy.enabled:
            super().start()

    def dropped_points(self) -> int:
        """Raw points this process's sweeps dropped so far."""
        with self._lock:
            return self.dropped_points_total

    def run_once(self) -> int:
        """Sweep until a sweep drops nothing or the sweeper stops; return the raw points dropped."""
        dropped = 0
        while not self._stopping.is_set():
            done = self.store.sweep_retention(self.policy, self._clock(), max_ranks=RANKS_PER_SWEEP)
            with self._lock:
                self.dropped_points_total += done.points
            dropped += done.points
            if not done.ranks:
                break
        return dropped

    def run_pass(self) -> None:
        try:
            self.run_once()
        except Exception:  # a database hiccup: the next pass retries what is due
            log.exception("retention sweep failed; the next pass retries it")


class CompactionSweeper(PeriodicThread):
    """Every ``interval_seconds``, compacts the ranks of ``store`` idle for ``idle_seconds`` with complete blocks not
    built (:meth:`Store.compact_idle`)."""

    def __init__(
        self,
        store: Store,
        interval_seconds: float = IDLE_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__("quantwatch-compaction", positive_seconds("interval_seconds", interval_seconds))
        self.store = store
        self.idle_seconds = idle_seconds
        self._clock = clock

    def run_pass(self) -> None:
        try:
            self.store.compact_idle(self._clock() - self.idle_seconds)
        except Exception:  # a database hiccup: the next pass retries what is due
            log.exception("compaction sweep failed; the next pass retries it")
