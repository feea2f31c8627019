"""Admission control for ingest, shared by the app (which makes one) and the ingest route (which consults it)."""

from __future__ import annotations

import math

import anyio


class IngestGate:
    """Admission control for ingest: at most ``limit`` requests held at once (reading their body, waiting for a worker
    thread, or being stored); the others are answered 429 before their body is read, so a burst of many ranks costs
    bounded memory and the agent, which honours ``Retry-After``, spools and backs off instead of piling up.

    Touched only on the event loop, so plain counters suffice. ``Retry-After`` is what the held requests need at the
    recent pace: pending × the moving average of a request's time, rounded up to whole seconds, 1–30. Of the held
    requests at most ``threads`` are decoded and stored at once, each on a worker thread (None: as many as anyio's
    default limiter lends).
    """

    def __init__(self, limit: int, threads: int | None = None) -> None:
        self.limit = limit
        self.threads = threads
        self.pending = 0
        self.average_seconds = 0.05
        self._limiter: anyio.CapacityLimiter | None = None

    def limiter(self) -> anyio.CapacityLimiter | None:
        """The worker threads' limiter (made on the event loop at its first use; None: anyio's default)."""
        if self.threads is not None and self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        return self._limiter

    def retry_after(self) -> int:
        """Seconds a refused client should wait."""
        return min(30, max(1, math.ceil(self.pending * self.average_seconds)))

    def record(self, seconds: float) -> None:
        """Fold the time of one stored request into the moving average (refused ones say nothing of the pace)."""
        self.average_seconds += 0.2 * (seconds - self.average_seconds)
