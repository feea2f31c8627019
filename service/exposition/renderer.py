"""The background renderer: a daemon thread that renders, between scrapes, the cache slots that batches changed."""

from __future__ import annotations

import logging
import time

from quantwatch.service.exposition.cache import LatestValueCache
from quantwatch.service.periodic import PeriodicThread, positive_seconds

__all__ = ["DEFAULT_RENDER_IDLE_AFTER_SECONDS", "DEFAULT_RENDER_INTERVAL_SECONDS", "BackgroundRenderer"]

# How often the background renderer renders what batches changed: it bounds the renderer's work per second whatever
# the batch rate, and how much a scrape can find left to render when batches arrive steadily.
DEFAULT_RENDER_INTERVAL_SECONDS = 0.25
# The renderer works only while someone scrapes: not at all until the first scrape, nor after this long without one.
DEFAULT_RENDER_IDLE_AFTER_SECONDS = 300.0

log = logging.getLogger("quantwatch.exposition")


class BackgroundRenderer(PeriodicThread):
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
        super().__init__("quantwatch-exposition", positive_seconds("interval_seconds", interval_seconds))
        self.cache = cache
        self.idle_after_seconds = positive_seconds("idle_after_seconds", idle_after_seconds)
        self.cpu_seconds = 0.0
        self.slots_rendered = 0
        self._failed = False

    def run_pass(self) -> None:
        scraped_at = self.cache.scraped_at
        if scraped_at is None or time.monotonic() - scraped_at > self.idle_after_seconds:
            return
        started = time.thread_time()
        try:
            self.slots_rendered += self.cache.render_changed()
        except Exception:  # a scrape renders what is left (and reports the error itself)
            if not self._failed:
                log.exception("background rendering of the exposition failed; scrapes render instead")
                self._failed = True
        self.cpu_seconds += time.thread_time() - started
