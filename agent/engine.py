"""The batch engine (OpenTelemetry ``BatchSpanProcessor`` style): a bounded queue of pending steps and one exporter
thread that resolves them, groups them into batches by size and time, and hands the batches to an exporter.

The training thread only appends to the queue (``submit``); when the queue is full the oldest pending step is dropped
and counted.  Everything slow — waiting for device copies, building records, encoding, HTTP, spooling, probing a
collector that was down — happens on the exporter thread.  ``flush(timeout)`` and ``close(timeout)`` wait at most
``timeout`` seconds: they have the queue exported, then let a spooling exporter deliver its spool (retrying transient
failures) for the rest of that time (the monitor reports the outcome as a :class:`DeliveryResult`).  After ``fork()``
the child starts with an empty queue and its own thread (lazily), never the parent's.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from quantwatch.agent.exporters import Exporter, SpoolingExporter
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.wire import Batch, StepRecord
from quantwatch.protocol import Action

__all__ = ["BatchEngine", "DeliveryResult", "PendingStep"]


@dataclass(frozen=True)
class DeliveryResult:
    """What ``Monitor.flush(timeout)`` or ``Monitor.close(timeout)`` achieved within its timeout.

    ``finished``: every step recorded before the call was exported or spooled (nothing is left only in memory).
    ``spool_batches``: batches still waiting in the disk spool afterwards (0: the collector has everything).
    Its truth value is ``finished``, as the plain bool these methods used to return; ``delivered`` says whether the
    collector has it all."""

    finished: bool
    spool_batches: int = 0

    @property
    def delivered(self) -> bool:
        """Everything recorded reached the collector: finished, and the spool is empty."""
        return self.finished and self.spool_batches == 0

    def __bool__(self) -> bool:
        return self.finished


@dataclass(frozen=True)
class PendingStep:
    """A step the training thread finished: ``resolve`` turns it into a record on the exporter thread (it may wait for
    a device-to-host copy there)."""

    layers: tuple[str, ...]
    resolve: Callable[[], StepRecord]
    #: Each layer's format per tensor kind, aligned with ``layers`` (None where unknown).
    formats: tuple[Mapping[str, str] | None, ...] | None = None
    #: Actions taken on the training job (``quantwatch.agent.actions``), sent in the batch that holds this step.
    actions: tuple[Action, ...] = ()


@dataclass(frozen=True)
class _Drain:
    """A request of flush/close to the exporter thread: deliver the spool until ``deadline`` (monotonic)."""

    number: int
    deadline: float


@dataclass
class _Group:
    """Consecutive steps of one batch: one layer list and formats, each step once."""

    layers: tuple[str, ...]
    formats: tuple[Mapping[str, str] | None, ...] | None
    records: dict[int, StepRecord]
    actions: list[Action]

    def add(self, record: StepRecord, actions: tuple[Action, ...]) -> None:
        """Add a step; an empty record of a step already here (the one that carries a step's actions) adds only
        its actions, and a step's full record replaces its empty one."""
        self.actions.extend(actions)
        held = self.records.get(record.step)
        if held is None or held.empty():
            self.records[record.step] = record


_ENGINES: weakref.WeakSet[BatchEngine] = weakref.WeakSet()


def _reinit_after_fork() -> None:
    for engine in list(_ENGINES):
        engine._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


@dataclass(frozen=True)
class BatchLimits:
    """How the engine batches: at most ``max_queue_steps`` steps waiting (the oldest dropped beyond), at most
    ``max_batch_steps`` per batch, and a batch sent at the latest ``max_delay_seconds`` after its first step."""

    max_queue_steps: int
    max_batch_steps: int
    max_delay_seconds: float

    def __post_init__(self) -> None:
        if self.max_queue_steps < 1 or self.max_batch_steps < 1:
            raise ValueError("max_queue_steps and max_batch_steps must be >= 1")
        if self.max_delay_seconds <= 0:
            raise ValueError("max_delay_seconds must be > 0")


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
        self.limits = BatchLimits(max_queue_steps, max_batch_steps, max_delay_seconds)
        self.exporter = exporter
        self.run = run
        self.rank = rank
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
        self._drain_requested = 0  # flush/close calls that asked for the spool to be delivered ...
        self._drain_done = 0  # ... and how many of them the exporter thread has served
        self._drain_deadline = 0.0
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
            if len(self._queue) >= self.limits.max_queue_steps:
                self._queue.popleft()
                self.dropped_steps += 1
                self._handled += 1
            if not self._queue:
                self._first_pending_at = time.monotonic()
            self._queue.append(pending)
            self._enqueued += 1
            self.submitted_steps += 1
            if len(self._queue) >= self.limits.max_batch_steps:
                self._cond.notify_all()

    def queued_steps(self) -> int:
        """Steps waiting in the queue."""
        with self._cond:
            return len(self._queue)

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export everything queued so far, then let a spooling exporter deliver its spool (retrying transient
        failures) for the rest of ``timeout_seconds``; True when every step queued before the call was exported or
        spooled in time (:meth:`spooled_batches` tells what waits on disk)."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            if self._closed:
                return True
            thread = self._thread
            if thread is None:
                if not isinstance(self.exporter, SpoolingExporter):
                    return True
                thread = self._start_thread()  # a spool left by an earlier process of this run is worth delivering
            target = self._enqueued
            self._flush_target = max(self._flush_target, target)
            request = self._request_drain(deadline)
            while self._handled < target or self._drain_done < request:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not thread.is_alive():
                    break
                self._cond.wait(remaining)
            return self._handled >= target

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Flush (the spool included, as :meth:`flush`), stop the thread and release the exporter, all within
        ``timeout_seconds``; True when every queued step was exported or spooled in time.

        Transient failures of batches still queued spool them at once instead of waiting between retries; the spool
        then gets the rest of the timeout, in order."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            if self._closed:
                return True
            self._closing = True
            if self._thread is None and isinstance(self.exporter, SpoolingExporter):
                self._start_thread()
            thread = self._thread
            target = self._enqueued
            self._request_drain(deadline)
        self.exporter.shutdown()
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._closed = True
            finished = self._handled >= target
        if thread is None or not thread.is_alive():
            try:
                self.exporter.close()
            except Exception as exc:
                self.failures.record("exporter_close", str(exc), exc)
        return finished

    def _request_drain(self, deadline: float) -> int:
        """Ask the exporter thread to deliver the spool until ``deadline`` (under the lock); the request's number."""
        self._drain_requested += 1
        self._drain_deadline = max(self._drain_deadline, deadline)
        self._cond.notify_all()
        return self._drain_requested

    def spooled_batches(self) -> int:
        """Batches waiting in the exporter's disk spool (0 for an exporter without one)."""
        try:
            return int(self.exporter.counters().get("spool_batches", 0))
        except Exception as exc:
            self.failures.record("exporter_counters", str(exc), exc)
            return 0

    def _start_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._worker, name="quantwatch-exporter", daemon=True)
        self._thread.start()
        return self._thread

    def _take(self) -> list[PendingStep] | _Drain | None:
        """Wait until a batch is due (size, age, flush or close) and take it, or a drain a flush/close asked for
        once nothing is due; ``[]`` means idle, None means exit."""
        with self._cond:
            while True:
                due = self._first_pending_at + self.limits.max_delay_seconds
                if self._queue and (
                    len(self._queue) >= self.limits.max_batch_steps
                    or self._closing
                    or self._flush_target > self._handled
                    or time.monotonic() >= due
                ):
                    count = min(len(self._queue), self.limits.max_batch_steps)
                    taken = [self._queue.popleft() for _ in range(count)]
                    self._first_pending_at = time.monotonic()
                    return taken
                if self._drain_done < self._drain_requested:
                    return _Drain(self._drain_requested, self._drain_deadline)
                if self._queue:
                    self._cond.wait(max(0.0, due - time.monotonic()))
                elif self._closing:
                    return None
                else:
                    self._cond.wait(self.limits.max_delay_seconds)
                    if not self._queue and not self._closing and self._drain_done >= self._drain_requested:
                        return []

    def _worker(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                self._idle()
                return
            if isinstance(taken, _Drain):
                self._drain(taken)
                continue
            if not taken:
                self._idle()
                continue
            self._export(taken)
            with self._cond:
                self._handled += len(taken)
                self._cond.notify_all()

    def _drain(self, request: _Drain) -> None:
        if isinstance(self.exporter, SpoolingExporter):
            try:
                self.exporter.drain(max(0.0, request.deadline - time.monotonic()))
            except Exception as exc:
                self.failures.record("exporter_drain", str(exc), exc)
        with self._cond:
            self._drain_done = max(self._drain_done, request.number)
            self._cond.notify_all()

    def _idle(self) -> None:
        try:
            self.exporter.idle()
        except Exception as exc:
            self.failures.record("exporter_idle", str(exc), exc)

    def _export(self, taken: list[PendingStep]) -> None:
        groups: list[_Group] = []
        for pending in taken:
            try:
                record = pending.resolve()
            except Exception as exc:
                self.failures.record("resolve_step", f"could not read a step's statistics: {exc}", exc)
                continue
            if not groups or (groups[-1].layers, groups[-1].formats) != (pending.layers, pending.formats):
                groups.append(_Group(pending.layers, pending.formats, {}, []))
            groups[-1].add(record, pending.actions)
        for group in groups:
            records = tuple(group.records.values())
            batch = Batch(
                self.run, self.rank, uuid.uuid4().hex, group.layers, records, group.formats, tuple(group.actions)
            )
            try:
                self.exporter.export(batch)
            except Exception as exc:
                self.failures.record("export", f"exporter failed: {exc}", exc)
                continue
            self.exported_batches += 1
