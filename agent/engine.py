"""The batch engine (OpenTelemetry ``BatchSpanProcessor`` style): a bounded queue of pending steps and one exporter
thread that resolves them, groups them into batches by size and time, and hands the batches to an exporter.

The training thread only appends to the queue (``submit``); when the queue is full the oldest pending step is dropped
and counted.  Everything slow — waiting for device copies, building records, encoding, HTTP, spooling — happens on
the exporter thread.  ``flush(timeout)`` and ``close(timeout)`` wait at most ``timeout`` seconds.  After ``fork()`` the
child starts with an empty queue and its own thread (lazily), never the parent's.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quantwatch.agent.exporters import Exporter
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.wire import Batch, StepRecord

__all__ = ["BatchEngine", "PendingStep"]


@dataclass(frozen=True)
class PendingStep:
    """A step the training thread finished: ``resolve`` turns it into a record on the exporter thread (it may wait for
    a device-to-host copy there)."""

    layers: tuple[str, ...]
    resolve: Callable[[], StepRecord]


_ENGINES: weakref.WeakSet[BatchEngine] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for engine in list(_ENGINES):
        engine._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


class BatchEngine:
    """Queue → batches → exporter, on one daemon thread."""

    def __init__(
        self,
        exporter: Exporter,
        *,
        run: str,
        rank: int,
        max_queue_steps: int = 2048,
        max_batch_steps: int = 64,
        max_delay_seconds: float = 2.0,
        failures: FailureLog | None = None,
    ) -> None:
        if max_queue_steps < 1 or max_batch_steps < 1:
            raise ValueError("max_queue_steps and max_batch_steps must be >= 1")
        if max_delay_seconds <= 0:
            raise ValueError("max_delay_seconds must be > 0")
        self.exporter = exporter
        self.run = run
        self.rank = rank
        self.max_queue_steps = max_queue_steps
        self.max_batch_steps = max_batch_steps
        self.max_delay_seconds = max_delay_seconds
        self.failures = failures or FailureLog()
        self.submitted_steps = 0
        self.dropped_steps = 0
        self.exported_batches = 0
        self._init_state()
        _ENGINES.add(self)

    def _init_state(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[PendingStep] = deque()
        self._first_pending_at = 0.0
        self._handled = 0
        self._enqueued = 0
        self._flush_target = 0
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def _after_fork_in_child(self) -> None:
        # The parent's queued steps and thread are the parent's; the child starts clean.
        self._init_state()

    def submit(self, pending: PendingStep) -> None:
        """Queue a finished step (drops the oldest queued step when full); never blocks on I/O."""
        with self._cond:
            if self._closed or self._closing:
                self.dropped_steps += 1
                return
            if self._thread is None:
                self._start_thread()
            if len(self._queue) >= self.max_queue_steps:
                self._queue.popleft()
                self.dropped_steps += 1
                self._handled += 1
            if not self._queue:
                self._first_pending_at = time.monotonic()
            self._queue.append(pending)
            self._enqueued += 1
            self.submitted_steps += 1
            if len(self._queue) >= self.max_batch_steps:
                self._cond.notify_all()

    def queued_steps(self) -> int:
        """Steps waiting in the queue."""
        with self._cond:
            return len(self._queue)

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export everything queued so far and replay a due spool; True when done within ``timeout_seconds``."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            if self._thread is None:
                return True
            target = self._enqueued
            self._flush_target = max(self._flush_target, target)
            self._cond.notify_all()
            while self._handled < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Flush, stop the thread and release the exporter; True when everything was handled within the timeout.

        Transient export failures during close go straight to the spool instead of being retried."""
        with self._cond:
            if self._closed:
                return True
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        self.exporter.shutdown()
        finished = True
        if thread is not None:
            thread.join(timeout_seconds)
            finished = not thread.is_alive()
        with self._cond:
            self._closed = True
        if finished:
            try:
                self.exporter.close()
            except Exception as exc:
                self.failures.record("exporter_close", str(exc), exc)
        return finished

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="quantwatch-exporter", daemon=True)
        self._thread.start()

    def _take(self) -> list[PendingStep] | None:
        """Wait until a batch is due (size, age, flush or close) and take it; None means exit."""
        with self._cond:
            while True:
                if self._queue:
                    due = self._first_pending_at + self.max_delay_seconds
                    if (
                        len(self._queue) >= self.max_batch_steps
                        or self._closing
                        or self._flush_target > self._handled
                        or time.monotonic() >= due
                    ):
                        count = min(len(self._queue), self.max_batch_steps)
                        taken = [self._queue.popleft() for _ in range(count)]
                        self._first_pending_at = time.monotonic()
                        return taken
                    self._cond.wait(max(0.0, due - time.monotonic()))
                elif self._closing:
                    return None
                else:
                    self._cond.wait(self.max_delay_seconds)
                    if not self._queue and not self._closing:
                        return []

    def _worker(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                self._idle()
                return
            if not taken:
                self._idle()
                continue
            self._export(taken)
            with self._cond:
                self._handled += len(taken)
                self._cond.notify_all()

    def _idle(self) -> None:
        try:
            self.exporter.idle()
        except Exception as exc:
            self.failures.record("exporter_idle", str(exc), exc)

    def _export(self, taken: list[PendingStep]) -> None:
        groups: list[tuple[tuple[str, ...], list[StepRecord]]] = []
        for pending in taken:
            try:
                record = pending.resolve()
            except Exception as exc:
                self.failures.record("resolve_step", f"could not read a step's statistics: {exc}", exc)
                continue
            if groups and groups[-1][0] == pending.layers:
                groups[-1][1].append(record)
            else:
                groups.append((pending.layers, [record]))
        for layers, records in groups:
            batch = Batch(self.run, self.rank, uuid.uuid4().hex, layers, tuple(records))
            try:
                self.exporter.export(batch)
            except Exception as exc:
                self.failures.record("export", f"exporter failed: {exc}", exc)
                continue
            self.exported_batches += 1
