"""Exporters: where finished batches go.

* :class:`HttpExporter` posts to a collector's ``/api/v1/ingest`` over one keep-alive ``httpx.Client``.  Connection
  errors, 408, 425, 429 and 5xx are retried with jittered exponential backoff, honouring ``Retry-After``; 401/403
  refuse the token, not the batch: the batch is spooled (logged loudly, once); other 4xx are permanent (logged once,
  counted, not retried).  When retries run out, or while the collector is known to be down, batches go to a bounded
  :class:`~quantwatch.agent.spool.DiskSpool` and are replayed oldest first as soon as it answers again: the
  collector is probed at most :data:`MAX_PROBE_INTERVAL_SECONDS` apart, on the exporter thread, and
  :meth:`HttpExporter.drain` (what ``flush``/``close`` call) keeps retrying until its timeout.
* :class:`InMemoryExporter` keeps batches in a list (tests, notebooks).
* :class:`JsonLinesExporter` appends each batch as one line of the JSON wire format, so a file can be posted to a
  collector later, line by line.

Exporters are called from the agent's exporter thread only; ``export`` never raises for transport failures.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx

from quantwatch.agent.errors import (
    ConfigError,
    CredentialExportError,
    ExportError,
    PermanentExportError,
    TransientExportError,
)
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.spool import DiskSpool
from quantwatch.agent.wire import Batch, EncodedBatch, Encoding, StepRecord, encode_batch, to_wire_dict
from quantwatch.protocol import FIRING_EPISODES_FIELD, INGEST_PATH, Backoff, is_transient_status, parse_retry_after

__all__ = [
    "MAX_PROBE_INTERVAL_SECONDS",
    "Exporter",
    "HttpExporter",
    "InMemoryExporter",
    "JsonLinesExporter",
    "RetryPolicy",
    "SpoolingExporter",
]

#: The longest pause between two probes of a collector that failed (the circuit's exponential backoff stops here,
#: unless the collector's own ``Retry-After`` asks for longer): a collector that is back is noticed within this, or
#: by the engine's next flush when that comes later.
MAX_PROBE_INTERVAL_SECONDS = 5.0


@runtime_checkable
class Exporter(Protocol):
    """What the batch engine hands finished batches to."""

    def export(self, batch: Batch) -> None:
        """Deliver (or durably keep) ``batch``; must not raise for transport failures."""

    def idle(self) -> None:
        """Called by the exporter thread when it has nothing to send (HTTP: replay the spool if it is due)."""

    def shutdown(self) -> None:
        """Stop retrying right away (transient failures now spool at once)."""

    def close(self) -> None:
        """Release resources once the engine stopped calling ``export``."""

    def counters(self) -> dict[str, int]:
        """Counters of what was sent, retried, spooled and dropped."""


@runtime_checkable
class SpoolingExporter(Protocol):
    """An exporter that keeps back what it could not deliver; ``flush``/``close`` give it time to deliver that."""

    def drain(self, timeout_seconds: float) -> int:
        """Deliver what was kept back, retrying transient failures for up to ``timeout_seconds``; return how many
        batches are still kept back."""


class RetryPolicy:
    """How many attempts a batch gets before it is spooled, and the shared backoff between them
    (:class:`quantwatch.protocol.Backoff`: attempt ``n`` (0-based) waits ``initial * 2**n`` capped at ``max_seconds``,
    jittered into [0.5, 1) of it, or the server's ``Retry-After`` when that is longer)."""

    def __init__(
        self,
        max_attempts: int = 4,
        initial_seconds: float = 0.25,
        max_seconds: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if initial_seconds < 0 or max_seconds < initial_seconds:
            raise ValueError("backoff needs 0 <= initial_seconds <= max_seconds")
        self.max_attempts = max_attempts
        self.initial_seconds = initial_seconds
        self.max_seconds = max_seconds
        self._backoff = Backoff(initial_seconds, max_seconds)
        self._rng = rng or random.Random()

    def backoff_seconds(self, attempt: int, retry_after_seconds: float | None = None) -> float:
        """The wait after failed attempt number ``attempt`` (0-based)."""
        return self._backoff.wait_seconds(attempt + 1, self._rng, retry_after_seconds)


class HttpExporter:
    """Posts batches to ``{url}/api/v1/ingest``; retries transient failures and spools what it cannot deliver."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        encoding: Encoding = "msgpack",
        compress: bool = True,
        timeout_seconds: float = 10.0,
        retry: RetryPolicy | None = None,
        spool: DiskSpool | None = None,
        transport: httpx.BaseTransport | None = None,
        failures: FailureLog | None = None,
    ) -> None:
        self.endpoint = url.rstrip("/") + INGEST_PATH
        self.encoding: Encoding = encoding
        self.compress = compress
        self.retry = retry or RetryPolicy()
        self.spool = spool
        self.failures = failures or FailureLog()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_seconds = timeout_seconds
        self._timeout = httpx.Timeout(timeout_seconds)
        self._transport = transport
        self._pid = os.getpid()
        self._client = self._new_client()
        #: Called on the exporter thread with each ingest answer's firing episodes (None: none fires); set by the
        #: monitor (:mod:`quantwatch.agent.actions`).
        self.on_answer: Callable[[list[dict[str, Any]] | None], None] | None = None
        self._stopping = threading.Event()
        self._not_before = 0.0
        self._probe_failures = 0
        self._counts = dict.fromkeys(
            (
                "sent_batches",
                "sent_points",
                "retried_requests",
                "spooled_batches",
                "replayed_batches",
                "rejected_batches",
                "dropped_batches",
                "dropped_points",
            ),
            0,
        )

    def _new_client(self) -> httpx.Client:
        return httpx.Client(timeout=self._timeout, transport=self._transport, headers=self._headers)

    def counters(self) -> dict[str, int]:
        """Counters: sent/replayed/spooled/rejected batches, retried requests, batches and points dropped (spool cap
        or no spool), and how many batches wait in the spool."""
        counts = dict(self._counts)
        if self.spool is not None:
            counts["dropped_batches"] += self.spool.dropped_batches
            counts["dropped_points"] += self.spool.dropped_points
            counts["spool_batches"] = len(self.spool)
            counts["spool_bytes"] = self.spool.size_bytes
        return counts

    def export(self, batch: Batch) -> None:
        """Encode and deliver ``batch`` after any spooled backlog, or spool it while the collector is unavailable."""
        self.deliver(encode_batch(batch, self.encoding, self.compress))

    def deliver(self, encoded: EncodedBatch) -> None:
        """Deliver an already encoded batch, keeping order behind the spool."""
        if os.getpid() != self._pid:
            # Forked child: the parent's pooled sockets are not ours to use.
            self._pid = os.getpid()
            self._client = self._new_client()
        self.drain_spool()
        if self.spool is not None and (len(self.spool) > 0 or time.monotonic() < self._not_before):
            self._to_spool(encoded)
            return
        try:
            self._send_with_retries(encoded)
        except TransientExportError as exc:
            self.failures.record("export_unavailable", f"collector unavailable, spooling: {exc}")
            self._open_circuit(exc.retry_after_seconds)
            self._to_spool(encoded)
        except CredentialExportError as exc:
            self._refused(exc)
            self._to_spool(encoded)
        except PermanentExportError as exc:
            self._counts["rejected_batches"] += 1
            self.failures.record(f"export_rejected_{exc.status_code}", str(exc))

    def drain_spool(self, deadline: float | None = None) -> ExportError | None:
        """Replay spooled batches oldest first while the circuit lets it, until the spool is empty or the collector
        fails again; return the failure that stopped the replay (the circuit is open then), else None.

        ``deadline`` (``time.monotonic()``) bounds each request's timeout."""
        if self.spool is None:
            return None
        while len(self.spool) > 0 and time.monotonic() >= self._not_before:
            entry = self.spool.oldest()
            if entry is None:
                return None
            try:
                self._post(entry.batch, deadline)
            except TransientExportError as exc:
                self._open_circuit(exc.retry_after_seconds)
                return exc
            except CredentialExportError as exc:
                self._refused(exc)
                return exc
            except PermanentExportError as exc:
                self._counts["rejected_batches"] += 1
                self.failures.record(f"export_rejected_{exc.status_code}", f"spooled batch rejected: {exc}")
                self.spool.remove(entry)
                continue
            self.spool.remove(entry)
            self._probe_failures = 0
            self._counts["replayed_batches"] += 1
            self._counts["sent_batches"] += 1
            self._counts["sent_points"] += entry.batch.points
        return None

    def drain(self, timeout_seconds: float) -> int:
        """Deliver the spool oldest first, retrying transient failures (connection refused while a collector
        restarts, 503, 429 with its ``Retry-After``) until it is empty or ``timeout_seconds`` pass; return the batches
        left in it.  A refused token (401/403) ends the drain at once: waiting does not heal it, and the spooled
        batches stay for ``quantwatch replay`` or the next process with the right token."""
        if self.spool is None:
            return 0
        deadline = time.monotonic() + timeout_seconds
        self._not_before = 0.0  # whatever the circuit said: the collector may be back since its last probe
        while len(self.spool) > 0:
            stopped = self.drain_spool(deadline)
            remaining = deadline - time.monotonic()
            if stopped is None or isinstance(stopped, CredentialExportError) or remaining <= 0:
                break
            time.sleep(min(max(0.0, self._not_before - time.monotonic()), remaining))
            self._not_before = 0.0
        return len(self.spool)

    def check_token(self, source: str, timeout_seconds: float = 2.0) -> None:
        """Ask the collector whether this exporter's token may ingest (an authenticated ``HEAD`` on the ingest
        route); raise :class:`ConfigError` for field ``source`` (where the token came from) when the collector
        refuses it (401) or it lacks the ``ingest`` scope (403).  Says nothing when the collector cannot tell right
        now (unreachable, an older collector without the probe, an error answer): the retries and the spool cover
        those."""
        try:
            response = self._client.head(self.endpoint, timeout=timeout_seconds)
        except httpx.HTTPError:
            return
        if response.status_code == 401:
            raise ConfigError(source, f"the collector at {self.endpoint} refuses this token (401: missing or unknown)")
        if response.status_code == 403:
            raise ConfigError(source, f"this token lacks the 'ingest' scope at {self.endpoint} (403)")

    def idle(self) -> None:
        """Replay the spool when it is due."""
        self.drain_spool()

    def shutdown(self) -> None:
        """Stop waiting between the retries of a new batch; from now on a transient failure spools it at once (and
        :meth:`drain`, which the engine calls next, retries the spool in order until the close's timeout)."""
        self._stopping.set()
        self._not_before = 0.0

    def close(self) -> None:
        """Close the HTTP client (after the engine has stopped calling ``export``)."""
        self._client.close()

    def _open_circuit(self, retry_after_seconds: float | None) -> None:
        wait = min(self.retry.backoff_seconds(self._probe_failures), MAX_PROBE_INTERVAL_SECONDS)
        if retry_after_seconds is not None:
            wait = max(wait, retry_after_seconds)
        self._probe_failures += 1
        self._not_before = time.monotonic() + wait

    def _refused(self, exc: CredentialExportError) -> None:
        where = f"kept in the spool at {self.spool.directory}" if self.spool is not None else "dropped (no spool)"
        self.failures.record(
            f"export_refused_{exc.status_code}",
            f"the collector refuses this job's token ({exc}); batches are {where}, and the collector is probed "
            "again. Fix the token (attach(token=...) or QUANTWATCH_TOKEN); the next process of this run, or "
            "`quantwatch replay SPOOL_DIR --token ...`, delivers what was kept",
            loud=True,
        )
        self._open_circuit(None)

    def _to_spool(self, encoded: EncodedBatch) -> None:
        if self.spool is None:
            self._counts["dropped_batches"] += 1
            self._counts["dropped_points"] += encoded.points
            return
        try:
            self.spool.append(encoded)
        except OSError as exc:
            self.failures.record("spool_write", f"cannot write the spool at {self.spool.directory}: {exc}", exc)
            self._counts["dropped_batches"] += 1
            self._counts["dropped_points"] += encoded.points
            return
        self._counts["spooled_batches"] += 1

    def _send_with_retries(self, encoded: EncodedBatch) -> None:
        for attempt in range(self.retry.max_attempts):
            try:
                self._post(encoded)
            except TransientExportError as exc:
                last = attempt == self.retry.max_attempts - 1
                if last or self._stopping.is_set():
                    raise
                if exc.retry_after_seconds is not None and exc.retry_after_seconds > self.retry.max_seconds:
                    # The server asks for a longer pause than we block for: spool and come back after it.
                    raise
                wait = self.retry.backoff_seconds(attempt, exc.retry_after_seconds)
                self._counts["retried_requests"] += 1
                if self._stopping.wait(wait):
                    raise
            else:
                self._counts["sent_batches"] += 1
                self._counts["sent_points"] += encoded.points
                self._probe_failures = 0
                return

    def _post(self, encoded: EncodedBatch, deadline: float | None = None) -> None:
        timeout: httpx.Timeout | float = self._timeout
        if deadline is not None:
            timeout = max(0.05, min(self._timeout_seconds, deadline - time.monotonic()))
        try:
            response = self._client.post(
                self.endpoint, content=encoded.body, headers=encoded.headers(), timeout=timeout
            )
        except httpx.TransportError as exc:
            raise TransientExportError(f"{type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if 200 <= status < 300:
            if self.on_answer is not None:
                self.on_answer(_firing_episodes(response))
            return
        detail = response.text[:500]
        if is_transient_status(status):
            raise TransientExportError(
                f"HTTP {status}: {detail}", parse_retry_after(response.headers.get("Retry-After"))
            )
        if status in (401, 403):
            raise CredentialExportError(f"HTTP {status} from {self.endpoint}: {_problem_detail(response)}", status)
        raise PermanentExportError(f"HTTP {status} from {self.endpoint}: {detail}", status)


def _firing_episodes(response: httpx.Response) -> list[dict[str, Any]] | None:
    """The ingest answer's ``firing_episodes`` (None when absent: nothing fires); parsed only when it is there."""
    if _FIRING_MARK not in response.content:
        return None
    try:
        episodes = response.json().get(FIRING_EPISODES_FIELD)
    except (ValueError, AttributeError):
        return None
    return episodes if isinstance(episodes, list) else None


_FIRING_MARK = f'"{FIRING_EPISODES_FIELD}"'.encode()


def _problem_detail(response: httpx.Response) -> str:
    """The ``detail`` of a problem+json answer, else the start of its body."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail else response.text[:200]


class InMemoryExporter:
    """Keeps every exported batch in :attr:`batches` (for tests and notebooks)."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self._lock = threading.Lock()
        self._counts = {"sent_batches": 0, "sent_points": 0}

    def export(self, batch: Batch) -> None:
        """Store ``batch``."""
        points = batch.point_count()
        with self._lock:
            self.batches.append(batch)
            self._counts["sent_batches"] += 1
            self._counts["sent_points"] += points

    def idle(self) -> None:
        """Nothing pending."""

    def shutdown(self) -> None:
        """Nothing to interrupt."""

    def close(self) -> None:
        """Nothing to release."""

    def counters(self) -> dict[str, int]:
        """Batches and points exported (counted as they come: the monitor reads this every sampled step, and
        counting the held batches again would cost more with every step of the run)."""
        with self._lock:
            return dict(self._counts)

    def records(self) -> Iterator[tuple[Batch, StepRecord]]:
        """Every step record with its batch, in export order."""
        with self._lock:
            batches = list(self.batches)
        for batch in batches:
            for record in batch.steps:
                yield batch, record

    def value(self, metric: str, layer: str, step: int) -> float | None:
        """The value of ``metric`` for ``layer`` at ``step`` (None when not measured); KeyError when never sent."""
        for batch, record in self.records():
            if record.step == step and metric in record.metrics and layer in batch.layers:
                return record.metrics[metric][batch.layers.index(layer)]
        raise KeyError((metric, layer, step))

    def scalar(self, name: str, step: int) -> float:
        """The scalar ``name`` at ``step``; KeyError when never sent."""
        for _batch, record in self.records():
            if record.step == step and name in record.scalars:
                return record.scalars[name]
        raise KeyError((name, step))


class JsonLinesExporter:
    """Appends each batch to ``path`` as one line of the JSON wire format (an ingest request body per line)."""

    def __init__(self, path: str | os.PathLike[str], failures: FailureLog | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.failures = failures or FailureLog()
        self._counts = {"sent_batches": 0, "sent_points": 0, "dropped_batches": 0}

    def export(self, batch: Batch) -> None:
        """Append ``batch`` as one JSON line and flush it to the file."""
        line = json.dumps(to_wire_dict(batch, "json"), separators=(",", ":"), allow_nan=False)
        try:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError as exc:
            self._counts["dropped_batches"] += 1
            self.failures.record("file_write", f"cannot append to {self.path}: {exc}", exc)
            return
        self._counts["sent_batches"] += 1
        self._counts["sent_points"] += batch.point_count()

    def idle(self) -> None:
        """Nothing pending: each batch is written when exported."""

    def shutdown(self) -> None:
        """Nothing to interrupt."""

    def close(self) -> None:
        """Nothing to release: the file is opened per batch."""

    def counters(self) -> dict[str, int]:
        """Batches and points written, batches that could not be written."""
        return dict(self._counts)
