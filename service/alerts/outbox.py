"""The delivery worker: sends committed outbox rows, at least once, with jittered exponential backoff.

One worker thread per app. It claims due rows with ``SELECT … FOR UPDATE SKIP LOCKED`` (PostgreSQL; SQLite has one
writer anyway) and a lease (``claimed_until``), commits the claim, sends outside any transaction (a slow receiver
holds no lock and never touches ingest), then records the outcome. A worker that dies mid-send leaves its rows to
be retried by any replica when the lease runs out, so delivery is at least once and receivers deduplicate on the
stable ``webhook-id``. Rows of one (episode, receiver) go out in order: a resolved notification waits for its firing.

Outcomes: 2xx delivered; 410 Gone disables the receiver (Standard Webhooks) and cancels its pending rows; 408, 425,
429, 5xx and network errors retry after ``min(max, base·2^(attempt−1))`` scaled by a random factor in [0.5, 1],
or after ``Retry-After`` when the receiver asks for longer, until ``expires_at`` (the horizon, 24 h by default);
other 4xx fail at once (the receiver refuses this request; ``POST /api/v1/deliveries/{id}/redeliver`` replays it).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.protocol import Backoff, is_transient_status, parse_retry_after
from quantwatch.service.alerts import repository
from quantwatch.service.alerts.engine import LEASE_SECONDS, receiver_spec
from quantwatch.service.alerts.tables import DeliveryRow, ReceiverRow
from quantwatch.service.alerts.webhooks import signature_headers

__all__ = ["DeliveryOutcome", "DeliveryWorker", "RetryPolicy", "parse_retry_after"]

log = logging.getLogger("quantwatch.alerts")


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff between attempts: ``min(max_seconds, base_seconds·2^(attempt−1))`` times a factor in [0.5, 1]."""

    base_seconds: float = 1.0
    max_seconds: float = 900.0

    def __post_init__(self) -> None:
        if not 0 < self.base_seconds <= self.max_seconds:
            raise ValueError("RetryPolicy: need 0 < base_seconds <= max_seconds")

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds before the next attempt after ``attempt`` failed ones (the protocol's one backoff rule)."""
        return Backoff(self.base_seconds, self.max_seconds).wait_seconds(attempt, rng, retry_after)


@dataclass(frozen=True)
class DeliveryOutcome:
    """What one attempt came to."""

    delivered: bool
    retry: bool
    gone: bool
    status_code: int | None
    retry_after: float | None
    error: str | None


def _take_write_lock(session: Session) -> None:
    # On SQLite the collector's engine turns this option into BEGIN IMMEDIATE: a read-then-write transaction never
    # fails upgrading its lock in WAL mode. PostgreSQL ignores it.
    session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})


class DeliveryWorker:
    """Background sender of outbox rows; ``start()``/``stop()`` with the app, ``wake()`` after an ingest commit."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        policy: RetryPolicy | None = None,
        batch_size: int = 32,
        concurrency: int = 8,
        poll_seconds: float = 1.0,
        lease_seconds: float = LEASE_SECONDS,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sessions = sessions
        self.policy = policy or RetryPolicy()
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._lease_seconds = lease_seconds
        self._clock = clock
        self._rng = random.Random()
        self._event = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="quantwatch-delivery")
        self._client = httpx.Client(transport=transport, follow_redirects=False)

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="quantwatch-outbox", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the worker; rows in flight finish or are retried later by their lease."""
        self._stopping.set()
        self._event.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def wake(self) -> None:
        """Look for due rows now rather than at the next poll."""
        self._event.set()

    def dispatch(self, delivery_ids: list[int]) -> None:
        """Send rows this process wrote already leased to itself, now, without claiming them (see AlertEngine)."""
        if self._stopping.is_set():
            return
        for delivery_id in delivery_ids:
            self._pool.submit(self._deliver_logged, delivery_id)

    def _deliver_logged(self, delivery_id: int) -> None:
        try:
            self._deliver(delivery_id)
        except Exception:  # the row stays leased and pending; a worker retries it when the lease runs out
            log.exception("delivery %s failed before its outcome was recorded", delivery_id)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sent = self.run_once()
            except Exception:  # the worker must outlive a database hiccup; the rows stay in the outbox
                log.exception("delivery worker: pass failed")
                sent = 0
            if sent:
                continue
            self._event.wait(self._poll_seconds)
            self._event.clear()

    def run_once(self) -> int:
        """Claim due rows, send them concurrently and record the outcomes; returns how many were attempted."""
        claimed = self._claim()
        if not claimed:
            return 0
        list(self._pool.map(self._deliver, claimed))
        return len(claimed)

    def _claim(self) -> list[int]:
        now = self._clock()
        with self._sessions.begin() as session:
            _take_write_lock(session)
            return repository.claim_deliveries(session, now, self._batch_size, now + self._lease_seconds)

    def _deliver(self, delivery_id: int) -> None:
        with self._sessions() as session:
            row = session.get(DeliveryRow, delivery_id)
            if row is None or row.status != "pending":
                return
            receiver_row = session.get(ReceiverRow, row.receiver_id)
            if receiver_row is None or not receiver_row.enabled:
                session.rollback()
                with self._sessions.begin() as writer:
                    _take_write_lock(writer)
                    repository.cancel_delivery(writer, delivery_id, "receiver disabled or deleted")
                return
            receiver = receiver_spec(receiver_row)
            body = row.body.encode()
            webhook_id, attempts, expires_at = row.webhook_id, row.attempts, row.expires_at
            receiver_id = receiver_row.id
            session.rollback()
        outcome = self.attempt(
            receiver.type,
            receiver.url,
            receiver.headers,
            receiver.secret_keys(),
            webhook_id,
            body,
            receiver.timeout_seconds,
        )
        self._record(delivery_id, outcome, attempts + 1, expires_at, receiver_id)

    def attempt(
        self,
        kind: str,
        url: str,
        headers: dict[str, str],
        keys: list[bytes],
        webhook_id: str,
        body: bytes,
        timeout_seconds: float,
    ) -> DeliveryOutcome:
        """One HTTP attempt: a signed webhook POST to ``url``, or a push to ``url``/api/v2/alerts."""
        now = self._clock()
        request_headers = {"content-type": "application/json", "user-agent": "quantwatch-alerts"}
        request_headers.update(headers)
        if kind == "alertmanager":
            target = url.rstrip("/") + "/api/v2/alerts"
        else:
            target = url
            request_headers.update(signature_headers(keys, webhook_id, int(now), body))
        try:
            response = self._client.post(target, content=body, headers=request_headers, timeout=timeout_seconds)
        except httpx.HTTPError as exc:
            return DeliveryOutcome(False, True, False, None, None, f"{type(exc).__name__}: {exc}"[:500])
        code = response.status_code
        if 200 <= code < 300:
            return DeliveryOutcome(True, False, False, code, None, None)
        retry_after = parse_retry_after(response.headers.get("retry-after"), now)
        error = f"HTTP {code}: {response.text[:300]}"
        if code == 410:
            return DeliveryOutcome(False, False, True, code, None, error)
        retry = is_transient_status(code)
        return DeliveryOutcome(False, retry, False, code, retry_after, error)

    def _record(
        self, delivery_id: int, outcome: DeliveryOutcome, attempts: int, expires_at: float, receiver_id: int
    ) -> None:
        now = self._clock()
        values: dict[str, object] = {
            "attempts": attempts,
            "claimed_until": None,
            "last_status_code": outcome.status_code,
            "last_error": outcome.error,
        }
        if outcome.delivered:
            values.update(status="delivered", delivered_at=now)
        elif outcome.retry:
            next_at = now + self.policy.delay(attempts, outcome.retry_after, self._rng)
            if next_at > expires_at:
                values.update(status="failed", last_error=f"{outcome.error} (gave up: delivery horizon reached)")
            else:
                values.update(next_attempt_at=next_at)
        else:
            values.update(status="failed")
        with self._sessions.begin() as session:
            _take_write_lock(session)
            repository.record_delivery_attempt(session, delivery_id, values)
            if outcome.gone:
                repository.disable_receiver(session, receiver_id, f"410 Gone at {now:.0f} (delivery {delivery_id})")
        if outcome.delivered:
            log.debug("delivered %s", delivery_id)
            self._event.set()  # a notification queued behind this one (same episode and receiver) may go now
        else:
            log.info("delivery %s attempt %d: %s", delivery_id, attempts, outcome.error)
