"""BatchEngine: batching by size and time, drop-oldest, flush/close timeouts, failures counted, fork safety."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import httpx

from quantwatch.agent.engine import BatchEngine, PendingStep
from quantwatch.agent.exporters import HttpExporter, InMemoryExporter, RetryPolicy
from quantwatch.agent.spool import DiskSpool
from quantwatch.agent.wire import Batch, StepRecord

LAYERS = ("a", "b")


def _pending(step: int, layers: tuple[str, ...] = LAYERS) -> PendingStep:
    return PendingStep(layers, lambda: StepRecord(step, float(step), {"m": [1.0] * len(layers)}, {}))


class BlockingExporter(InMemoryExporter):
    """Blocks in ``export`` until released, to hold the exporter thread busy."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, batch: Batch) -> None:
        self.entered.set()
        self.release.wait(10)
        super().export(batch)


def _steps(exporter: InMemoryExporter) -> list[int]:
    return [record.step for _batch, record in exporter.records()]


def test_batches_by_size() -> None:
    exporter = InMemoryExporter()
    engine = BatchEngine(exporter, run="r", rank=0, max_batch_steps=3, max_delay_seconds=60)
    for step in range(7):
        engine.submit(_pending(step))
    assert engine.flush(10)
    assert [len(b.steps) for b in exporter.batches] == [3, 3, 1]
    assert _steps(exporter) == list(range(7))
    assert len({b.batch_id for b in exporter.batches}) == 3
    assert engine.close(5)


def test_batches_by_time(wait_until: Callable[..., bool]) -> None:
    exporter = InMemoryExporter()
    engine = BatchEngine(exporter, run="r", rank=0, max_batch_steps=100, max_delay_seconds=0.05)
    engine.submit(_pending(1))
    assert wait_until(lambda: len(exporter.batches) == 1)
    assert engine.close(5)


def test_a_change_of_layers_starts_a_new_batch() -> None:
    exporter = InMemoryExporter()
    engine = BatchEngine(exporter, run="r", rank=3, max_batch_steps=10, max_delay_seconds=60)
    engine.submit(_pending(1))
    engine.submit(_pending(2, ("a", "b", "k")))
    assert engine.close(5)
    assert [b.layers for b in exporter.batches] == [LAYERS, ("a", "b", "k")]
    assert {b.rank for b in exporter.batches} == {3}


def test_full_queue_drops_the_oldest_and_counts() -> None:
    exporter = BlockingExporter()
    engine = BatchEngine(exporter, run="r", rank=0, max_queue_steps=4, max_batch_steps=1, max_delay_seconds=60)
    engine.submit(_pending(0))
    assert exporter.entered.wait(5)  # step 0 is in flight; the queue now fills up
    for step in range(1, 11):
        engine.submit(_pending(step))
    assert engine.dropped_steps == 6
    exporter.release.set()
    assert engine.flush(10)
    assert _steps(exporter) == [0, 7, 8, 9, 10]
    assert engine.close(5)


def test_flush_and_close_give_up_after_their_timeout() -> None:
    exporter = BlockingExporter()
    engine = BatchEngine(exporter, run="r", rank=0, max_batch_steps=1, max_delay_seconds=60)
    engine.submit(_pending(0))
    assert exporter.entered.wait(5)
    assert engine.flush(0.05) is False
    assert engine.close(0.05) is False
    exporter.release.set()


def _spooling_engine(
    tmp_path: Any, handler: Callable[[httpx.Request], httpx.Response], retry: RetryPolicy, steps: int
) -> tuple[HttpExporter, BatchEngine, DiskSpool]:
    """An engine over an HTTP exporter with a spool, posting to ``handler``, with ``steps`` steps submitted."""
    spool = DiskSpool(tmp_path, 1 << 20)
    exporter = HttpExporter("http://c.test", transport=httpx.MockTransport(handler), retry=retry, spool=spool)
    engine = BatchEngine(exporter, run="r", rank=0, max_batch_steps=1, max_delay_seconds=60)
    for step in range(steps):
        engine.submit(_pending(step))
    return exporter, engine, spool


def test_close_interrupts_retries_and_spools(tmp_path: Any) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down")

    slow_retries = RetryPolicy(max_attempts=100, initial_seconds=30, max_seconds=30)
    _exporter, engine, spool = _spooling_engine(tmp_path, refuse, slow_retries, 3)
    assert engine.close(1)  # does not sit through 100 retries of 30 s
    assert len(spool) == 3
    assert engine.submitted_steps == 3


def test_resolve_failure_is_counted_not_raised() -> None:
    exporter = InMemoryExporter()
    engine = BatchEngine(exporter, run="r", rank=0, max_delay_seconds=60)

    def broken() -> StepRecord:
        raise RuntimeError("boom")

    engine.submit(PendingStep(LAYERS, broken))
    engine.submit(_pending(2))
    assert engine.close(5)
    assert engine.failures.counts() == {"resolve_step": 1}
    assert _steps(exporter) == [2]


def test_submit_after_close_is_dropped() -> None:
    engine = BatchEngine(InMemoryExporter(), run="r", rank=0)
    assert engine.close(1)
    engine.submit(_pending(1))
    assert engine.dropped_steps == 1


def test_fork_child_gets_its_own_queue_and_thread() -> None:
    exporter = BlockingExporter()
    engine = BatchEngine(exporter, run="r", rank=0, max_batch_steps=1, max_delay_seconds=60)
    engine.submit(_pending(0))
    assert exporter.entered.wait(5)
    engine.submit(_pending(1))  # queued in the parent while the exporter thread is busy
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's queue and busy thread are not inherited
        try:
            child_exporter = InMemoryExporter()
            engine.exporter = child_exporter
            ok = engine.queued_steps() == 0
            engine.submit(_pending(42))
            ok = ok and engine.flush(5) and _steps(child_exporter) == [42]
            os.write(write_fd, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    assert os.read(read_fd, 8) == b"ok"
    os.close(read_fd)
    exporter.release.set()
    assert engine.flush(5)
    assert _steps(exporter) == [0, 1]
    assert engine.close(5)


def test_flush_and_close_deliver_the_spool_to_a_collector_that_comes_back(tmp_path: Any) -> None:
    """The exporter thread retries the spool until the timeout: a collector starting up late still gets it all."""
    import time

    back_at = [float("inf")]
    stored: list[bytes] = []

    def collector(request: httpx.Request) -> httpx.Response:
        if time.monotonic() < back_at[0]:
            raise httpx.ConnectError("down")
        stored.append(request.read())
        return httpx.Response(200, json={"points": 0})

    fast = RetryPolicy(max_attempts=1, initial_seconds=0.01, max_seconds=0.05)
    exporter, engine, _spool = _spooling_engine(tmp_path, collector, fast, 3)
    assert engine.flush(0.2)  # down: every step is spooled, the spool retried for the rest of the time
    assert engine.spooled_batches() == 3
    back_at[0] = time.monotonic() + 0.3
    engine.submit(_pending(3))
    assert engine.close(30)
    assert engine.spooled_batches() == 0
    assert len(stored) == 4
    assert exporter.counters()["replayed_batches"] == 4
