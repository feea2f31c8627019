"""Log-once-and-count: how the agent reports its own failures without raising into the training loop."""

from __future__ import annotations

import logging
import threading
from collections import Counter

__all__ = ["FailureLog"]

logger = logging.getLogger("quantwatch.agent")


class FailureLog:
    """Counts failures by kind and logs the first one of each kind (with its traceback when one is given)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def record(self, kind: str, message: str, exc: BaseException | None = None, *, loud: bool = False) -> None:
        """Count a failure of ``kind``; log it when it is the first of its kind (at ERROR level when ``loud``: a
        failure the user has to act on, such as a refused token)."""
        with self._lock:
            self._counts[kind] += 1
            first = self._counts[kind] == 1
        if first:
            logger.log(
                logging.ERROR if loud else logging.WARNING,
                "quantwatch agent: %s: %s (further failures of this kind are counted, not logged)",
                kind,
                message,
                exc_info=exc,
            )

    def counts(self) -> dict[str, int]:
        """Failures so far, by kind."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """Failures so far, all kinds together."""
        with self._lock:
            return sum(self._counts.values())
