"""One retry policy for every client of an HTTP peer: the agent's exporter, the webhook outbox and the CLI client.

Transient answers are network errors, 408, 425, 429 and every 5xx; every other answer is final. After ``n`` failed
attempts the wait is the jittered backoff ``min(max, initial·2^(n−1))`` times a factor in [0.5, 1], or the peer's
``Retry-After`` when it asks for longer: the larger of the two, never less than the peer asked for.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

__all__ = ["TRANSIENT_4XX", "Backoff", "is_transient_status", "parse_retry_after"]

TRANSIENT_4XX = frozenset({408, 425, 429})
"""4xx answers that say "try again" (request timeout, too early, too many requests)."""


def is_transient_status(status: int) -> bool:
    """Whether an HTTP answer with ``status`` is worth retrying."""
    return status in TRANSIENT_4XX or status >= 500


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date, RFC 9110 §10.2.3); None when
    absent or invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential backoff, counted in failed attempts (the first failure is ``failures=1``)."""

    initial_seconds: float
    max_seconds: float

    def __post_init__(self) -> None:
        if not 0 <= self.initial_seconds <= self.max_seconds:
            raise ValueError(
                f"Backoff: need 0 <= initial_seconds ({self.initial_seconds}) <= max_seconds ({self.max_seconds})"
            )

    def wait_seconds(self, failures: int, rng: random.Random, retry_after: float | None = None) -> float:
        """Seconds to wait after ``failures`` failed attempts: the larger of the jittered backoff and
        ``retry_after``."""
        exponent = min(max(0, failures - 1), 62)
        backoff = min(self.max_seconds, self.initial_seconds * 2.0**exponent) * rng.uniform(0.5, 1.0)
        return backoff if retry_after is None else max(backoff, retry_after)
