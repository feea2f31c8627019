"""The exposition's state rebuilt from the database when the collector starts.

Without it a restarted collector exports nothing for the runs stored before the restart: no latest values, and no
``quantwatch_alert_state`` for an episode still firing in the database, so a Prometheus alert built on the exported
state would resolve on every restart. :class:`StartupRestore` reads, in a background thread (the collector answers
at once), the runs seen within the cache's TTL: per (run, rank) the latest value of every layer and scalar and the
last step (into :meth:`LatestValueCache.restore`, which keeps the top-K as ingest does and never replaces what a
batch brought first), and the pending and firing series of their open episodes (the alert streaks and states,
until this process evaluates the same series itself). Every read is bounded by :class:`RestoreLimits`.

The alert series are read again every ``refresh_seconds`` for the restored runs still exported: with several
replicas on one database, a run another replica ingests must not stay firing here after that replica resolved it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.exposition.alert_states import StoredSeries
from quantwatch.service.exposition.cache import LatestValueCache
from quantwatch.service.exposition.queries import RankReader, RestoreLimits, open_alert_series, recent_runs

__all__ = ["StartupRestore"]

log = logging.getLogger("quantwatch.exposition")


class StartupRestore:
    """Rebuilds a :class:`LatestValueCache` and the alert series from the database, once, in a daemon thread.

    ``alert_series`` is the restored half of :func:`~.alert_states.alert_series_source`. After :meth:`wait`,
    ``runs_restored``, ``ranks_restored``, ``series_restored`` and ``seconds`` say what it did; a failure is logged
    and leaves the exposition to ingest alone, as before restores existed.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        limits: RestoreLimits | None = None,
        clock: Callable[[], float] = time.time,
        refresh_seconds: float = 15.0,
    ) -> None:
        if isinstance(refresh_seconds, bool) or not isinstance(refresh_seconds, (int, float)) or refresh_seconds <= 0:
            raise ValueError(f"refresh_seconds must be a number > 0, got {refresh_seconds!r}")
        self.sessions = sessions
        self.refresh_seconds = float(refresh_seconds)
        self.limits = limits if limits is not None else RestoreLimits()
        self._clock = clock
        self._series: tuple[StoredSeries, ...] = ()
        self._restored_runs: frozenset[str] = frozenset()
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs_restored = 0
        self.ranks_restored = 0
        self.series_restored = 0
        self.seconds = 0.0
        self.failed = False

    def alert_series(self) -> Sequence[StoredSeries]:
        """The pending and firing series read at start (empty until read)."""
        return self._series

    def start(self, cache: LatestValueCache) -> None:
        """Restore into ``cache`` in a daemon thread, then refresh the alert series (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, args=(cache,), name="quantwatch-exposition-restore", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the (run, rank) being read, or the refresh."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the restore has finished (or failed); returns whether it has."""
        return self._done.wait(timeout)

    def restore(self, cache: LatestValueCache) -> None:
        """Read the database and restore into ``cache``, in the calling thread."""
        started = time.perf_counter()
        since = self._clock() - cache.run_ttl_seconds
        with self.sessions() as session:
            runs = recent_runs(session, since, self.limits.max_runs)
            self._restored_runs = frozenset(run.name for run in runs)
            self._series = tuple(open_alert_series(session, sorted(self._restored_runs), cache.top_k))
        self.series_restored = len(self._series)
        reader = RankReader(self.limits)
        for run in runs:
            with self.sessions() as session:
                for stored in reader.stored_ranks(session, run):
                    if self._stopping.is_set():
                        return
                    self.ranks_restored += cache.restore(stored)
            self.runs_restored += 1
        self.seconds = time.perf_counter() - started
        log.info(
            "exposition restored %d runs (%d ranks) and %d alert series from the database in %.2f s",
            self.runs_restored,
            self.ranks_restored,
            self.series_restored,
            self.seconds,
        )

    def refresh(self, cache: LatestValueCache) -> None:
        """Read the alert series of the restored runs that ``cache`` still holds again."""
        runs = sorted(self._restored_runs & cache.run_names())
        with self.sessions() as session:
            self._series = tuple(open_alert_series(session, runs, cache.top_k))

    def _run(self, cache: LatestValueCache) -> None:
        try:
            self.restore(cache)
        except Exception:  # the collector serves on: ingest fills the exposition as it did before restores
            self.failed = True
            log.exception("restoring the exposition from the database failed; /metrics shows ingest alone")
            return
        finally:
            self._done.set()
        failing = False
        while not self._stopping.wait(self.refresh_seconds):
            try:
                self.refresh(cache)
                failing = False
            except Exception:  # keeps the series read last; logged once per run of failures
                if not failing:
                    log.exception("refreshing the restored alert series failed; keeping the last ones read")
                failing = True
