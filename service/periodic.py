"""A daemon thread that runs one pass every interval: the collector's background work off the request path (the
exposition's renderer, the retention sweeper)."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod


def positive_seconds(field: str, value: object) -> float:
    """``value`` as seconds, or ValueError naming ``field`` unless it is a number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{field}: must be a number > 0, got {value!r}")
    return float(value)


class PeriodicThread(ABC):
    """Runs :meth:`run_pass` every ``interval_seconds`` on a daemon thread named ``name``, between :meth:`start` and
    :meth:`stop`. A pass handles its own errors: one that raises ends the thread."""

    def __init__(self, name: str, interval_seconds: float) -> None:
        self.interval_seconds = interval_seconds
        self._name = name
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @abstractmethod
    def run_pass(self) -> None:
        """One pass of the thread's work (the subclass's)."""

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
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
            self.run_pass()
