"""The background renderer: a daemon thread that renders, between scrapes, the cache slots that batches changed."""

from __future__ import annotations

import logging
import threading
import time

from quantwatch.service.exposition.cache import LatestValueCache

__all__ = ["DEFAULT_RENDER_IDLE_AFTER_SECONDS", "DEFAULT_RENDER_INTERVAL_SECONDS", "BackgroundRenderer"]

# How often the background renderer renders what batches changed: it bounds the renderer's work per second whatever
# the batch rate, and how much a scrape can find left to render when batches arrive steadily.
DEFAULT_RENDER_INTERVAL_SECONDS = 0.25
# The renderer works only while someone scrapes: not at all until the first scrape, nor after this long without one.
DEFAULT_RENDER_IDLE_AFTER_SECONDS = 300.0

log = logging.getLogger("quantwatch.exposition")


class BackgroundRenderer:
    """A daemon thread rendering the slots that batches changed, between scrapes, every ``interval_seconds``.

    A scrape then only renders what changed since the last pass, so its time no longer grows with how many runs sent
    a batch since the previous scrape; it still renders whatever is left, so its answer is never stale. The work per
    second is bounded by the interval, not by the batch rate: a slot that ten batches changed between two passes is
    rendered once. Nothing is rendered ahead until the first scrape or after ``idle_after_seconds`` without one (a
    collector nobody scrapes spends nothing). ``cpu_seconds`` and ``slots_rendered`` say what it cost.
    """

    def __init__(
        self,
        cache: LatestValueCache,
        interval_seconds: float = DEFAULT_RENDER_INTERVAL_SECONDS,
        idle_after_seconds: float = DEFAULT_RENDER_IDLE_AFTER_SECONDS,
    ) -> None:
        for name, value in (("interval_seconds", interval_seconds), ("idle_after_seconds", idle_after_seconds)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.cache = cache
        self.interval_seconds = float(interval_seconds)
        self.idle_after_seconds = float(idle_after_seconds)
        self.cpu_seconds = 0.0
        self.slots_rendered = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name="quantwatch-exposition", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the pass in progress."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():  # kept while it runs on: a later start() must not add a second thread
                self._thread = None

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval_seconds):
            scraped_at = self.cache.scraped_at
            if scraped_at is None or time.monotonic() - scraped_at > self.idle_after_seconds:
                continue
            started = time.thread_time()
            try:
                self.slots_rendered += self.cache.render_changed()
            except Exception:  # a scrape renders what is left (and reports the error itself)
                if not self._failed:
                    log.exception("background rendering of the exposition failed; scrapes render instead")
                    self._failed = True
            self.cpu_seconds += time.thread_time() - started
