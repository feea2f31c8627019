"""HttpExporter: retry classes, Retry-After, permanent errors, spool and replay order, restart replay —
against httpx.MockTransport and against a real HTTP server on loopback."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quantwatch.agent.exporters import HttpExporter, RetryPolicy, parse_retry_after
from quantwatch.agent.spool import DiskSpool
from quantwatch.agent.wire import Batch, StepRecord

FAST = RetryPolicy(max_attempts=3, initial_seconds=0.001, max_seconds=0.01)


def _batch(step: int, batch_id: str | None = None) -> Batch:
    record = StepRecord(step, 1.0 + step, {"output_rel_l2": [0.1 * step, 0.2]}, {"loss": float(step)})
    return Batch("run-a", 0, batch_id or f"b{step}", ("l0", "l1"), (record,))


class Scripted:
    """A MockTransport handler answering from a script; entries are status codes, (status, headers) or exceptions."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.seen.append(request)
        reply = self.script.pop(0) if self.script else 200
        if isinstance(reply, Exception):
            raise reply
        status, headers = reply if isinstance(reply, tuple) else (reply, {})
        return httpx.Response(status, headers=headers, json={"points": 0})

    def batch_ids(self, decode: Callable[..., dict[str, Any]]) -> list[str]:
        return [
            decode(r.content, r.headers["Content-Type"], r.headers.get("Content-Encoding"))["batch_id"]
            for r in self.seen
        ]


def _exporter(handler: Scripted, spool: DiskSpool | None = None, **kwargs: Any) -> HttpExporter:
    return HttpExporter(
        "http://collector.test/", transport=httpx.MockTransport(handler), retry=FAST, spool=spool, **kwargs
    )


def test_posts_msgpack_gzip_with_bearer_token() -> None:
    handler = Scripted(200)
    exporter = _exporter(handler, token="s3cret")
    exporter.export(_batch(1))
    (request,) = handler.seen
    assert request.url == "http://collector.test/api/v1/ingest"
    assert request.headers["Authorization"] == "Bearer s3cret"
    assert request.headers["Content-Type"] == "application/msgpack"
    assert request.headers["Content-Encoding"] == "gzip"
    assert exporter.counters()["sent_batches"] == 1
    assert exporter.counters()["sent_points"] == 3


@pytest.mark.parametrize(
    "failure",
    [httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), 408, 425, 429, 500, 502, 503],
    ids=["connect", "timeout", "408", "425", "429", "500", "502", "503"],
)
def test_transient_failures_are_retried(failure: Any) -> None:
    handler = Scripted(failure, 200)
    exporter = _exporter(handler)
    exporter.export(_batch(1))
    assert len(handler.seen) == 2
    counters = exporter.counters()
    assert counters["sent_batches"] == 1
    assert counters["retried_requests"] == 1
    assert counters["rejected_batches"] == 0


@pytest.mark.parametrize("status", [400, 404, 413, 415, 422])
def test_other_4xx_are_permanent_logged_once_and_counted(status: int, caplog: pytest.LogCaptureFixture) -> None:
    handler = Scripted(status, status)
    exporter = _exporter(handler)
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        exporter.export(_batch(1))
        exporter.export(_batch(2))
    assert len(handler.seen) == 2  # one request per batch: never retried
    assert exporter.counters()["rejected_batches"] == 2
    assert exporter.counters()["retried_requests"] == 0
    assert len([r for r in caplog.records if f"export_rejected_{status}" in r.getMessage()]) == 1
    assert exporter.failures.counts() == {f"export_rejected_{status}": 2}


def test_retry_after_is_honoured_between_attempts() -> None:
    handler = Scripted((503, {"Retry-After": "1"}), 200)
    times: list[float] = []
    original = handler.__call__

    def timed(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        return original(request)

    exporter = HttpExporter(
        "http://collector.test",
        transport=httpx.MockTransport(timed),
        retry=RetryPolicy(max_attempts=3, initial_seconds=0.001, max_seconds=5.0),
    )
    exporter.export(_batch(1))
    assert exporter.counters()["sent_batches"] == 1
    assert times[1] - times[0] >= 1.0


def test_retry_after_longer_than_the_blocking_cap_spools_and_waits(tmp_path: Path, decode: Any) -> None:
    handler = Scripted((429, {"Retry-After": "3600"}))
    spool = DiskSpool(tmp_path, 1 << 20)
    exporter = _exporter(handler, spool)
    exporter.export(_batch(1))
    exporter.export(_batch(2))
    exporter.idle()
    assert len(handler.seen) == 1  # nothing is sent before the server's hour is over
    assert len(spool) == 2
    assert exporter.counters()["spooled_batches"] == 2


def test_retry_after_http_date() -> None:
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412480.0 - 60) == pytest.approx(60.0)
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_backoff_is_exponential_jittered_and_capped() -> None:
    policy = RetryPolicy(max_attempts=8, initial_seconds=1.0, max_seconds=8.0)
    for attempt, base in enumerate([1.0, 2.0, 4.0, 8.0, 8.0]):
        waits = {policy.backoff_seconds(attempt) for _ in range(50)}
        assert all(base * 0.5 <= w < base for w in waits)
        assert len(waits) > 1


def test_spool_keeps_order_and_replays_before_new_batches(tmp_path: Path, decode: Any) -> None:
    outage = [httpx.ConnectError("down")] * 3  # batch 1 exhausts its three attempts
    handler = Scripted(*outage)
    spool = DiskSpool(tmp_path, 1 << 20)
    exporter = _exporter(handler, spool)
    exporter.export(_batch(1))
    assert exporter.counters()["spooled_batches"] == 1
    exporter._not_before = float("inf")  # still down: the next ones go straight to the spool
    exporter.export(_batch(2))
    exporter.export(_batch(3))
    assert len(handler.seen) == 3
    exporter._not_before = 0.0  # the collector is back
    exporter.export(_batch(4))
    assert handler.batch_ids(decode)[3:] == ["b1", "b2", "b3", "b4"]
    assert len(spool) == 0
    assert exporter.counters()["replayed_batches"] == 3
    assert exporter.counters()["sent_batches"] == 4


def test_spool_cap_drops_oldest_and_counts(tmp_path: Path, decode: Any) -> None:
    handler = Scripted(*[httpx.ConnectError("down")] * 3)
    spool = DiskSpool(tmp_path, 1)  # every new entry pushes out the previous one
    exporter = _exporter(handler, spool)
    for step in range(1, 5):
        exporter.export(_batch(step))
        exporter._not_before = float("inf")
    counters = exporter.counters()
    assert counters["spooled_batches"] == 4
    assert counters["dropped_batches"] == 3
    assert counters["dropped_points"] == 9
    exporter._not_before = 0.0
    exporter.idle()
    assert handler.batch_ids(decode)[3:] == ["b4"]


def test_no_spool_means_dropped_and_counted() -> None:
    handler = Scripted(*[httpx.ConnectError("down")] * 3)
    exporter = _exporter(handler)
    exporter.export(_batch(1))
    assert exporter.counters()["dropped_batches"] == 1
    assert exporter.counters()["dropped_points"] == 3


def test_next_process_replays_the_spool_of_the_same_run(tmp_path: Path, decode: Any) -> None:
    first = _exporter(Scripted(*[httpx.ConnectError("down")] * 3), DiskSpool(tmp_path, 1 << 20))
    first.export(_batch(1))
    first._not_before = float("inf")
    first.export(_batch(2))
    first.close()
    handler = Scripted()
    second = _exporter(handler, DiskSpool(tmp_path, 1 << 20))
    second.export(_batch(3))
    assert handler.batch_ids(decode) == ["b1", "b2", "b3"]
    assert not list(tmp_path.iterdir())


def test_spooled_batch_rejected_on_replay_is_dropped_not_retried_forever(tmp_path: Path, decode: Any) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    exporter = _exporter(Scripted(*[httpx.ConnectError("down")] * 3, 400), spool)
    exporter.export(_batch(1))
    exporter._not_before = 0.0
    exporter.idle()
    assert len(spool) == 0
    assert exporter.counters()["rejected_batches"] == 1


def test_real_server_keep_alive_and_retry(scripted_collector: Any) -> None:
    scripted_collector.script = [(503, {}), (200, {})]
    exporter = HttpExporter(scripted_collector.url, retry=FAST, encoding="json")
    for step in range(1, 5):
        exporter.export(_batch(step))
    exporter.close()
    assert [d["batch_id"] for d in scripted_collector.accepted()] == ["b1", "b2", "b3", "b4"]
    assert len(scripted_collector.requests) == 5
    assert len(scripted_collector.connections) == 1  # one keep-alive connection for all requests
    assert scripted_collector.accepted()[0]["steps"][0]["metrics"]["output_rel_l2"] == [0.1, 0.2]


def test_real_server_down_then_up_replays_in_order(tmp_path: Path, scripted_collector: Any) -> None:
    from socket import socket

    with socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    spool = DiskSpool(tmp_path, 1 << 20)
    down = HttpExporter(dead_url, retry=FAST, spool=spool)
    for step in range(1, 4):
        down.export(_batch(step))
    assert down.counters()["spooled_batches"] == 3
    down.close()
    up = HttpExporter(scripted_collector.url, retry=FAST, spool=DiskSpool(tmp_path, 1 << 20))
    up.export(_batch(4))
    up.close()
    assert [d["batch_id"] for d in scripted_collector.accepted()] == ["b1", "b2", "b3", "b4"]


def test_real_collector_at_its_ingest_limit_throttles_and_the_exporter_waits_it_out(
    make_app: Callable[..., Any],
) -> None:
    """The collector's 429 + Retry-After (ingest limit reached) is retried after the delay and nothing is lost."""
    import threading

    from quantwatch.service.server import BackgroundServer

    entered, release = threading.Event(), threading.Event()

    class Holding:
        def on_batch(self, session: Any, run_row: Any, batch: Any) -> None:
            if batch.batch_id == "held":
                entered.set()
                release.wait(30)

        def after_commit(self, batch: Any) -> None:
            pass

    app = make_app(max_pending_ingest=1)
    app.state.ingest_observers.append(Holding())
    with BackgroundServer(app) as server:
        other = HttpExporter(server.url, retry=FAST, encoding="json")
        holder = threading.Thread(target=other.export, args=(_batch(1, "held"),))
        holder.start()
        assert entered.wait(30)

        class ReleaseOnceThrottled(httpx.HTTPTransport):
            """The real transport; the held batch is let through once the collector has refused this exporter."""

            def handle_request(self, request: httpx.Request) -> httpx.Response:
                response = super().handle_request(request)
                if response.status_code == 429:
                    release.set()
                return response

        exporter = HttpExporter(
            server.url,
            transport=ReleaseOnceThrottled(),
            retry=RetryPolicy(max_attempts=4, initial_seconds=0.01),
            encoding="json",
        )
        started = time.monotonic()
        exporter.export(_batch(2))
        waited = time.monotonic() - started
        holder.join(30)
        exporter.close()
        other.close()
        counts = exporter.counters()
        assert counts["retried_requests"] >= 1
        assert waited >= 1.0  # the collector's Retry-After (whole seconds, at least 1), not the 10 ms backoff
        assert (counts["sent_batches"], counts["dropped_batches"], counts["rejected_batches"]) == (1, 0, 0)
        stored = httpx.get(f"{server.url}/api/v1/runs/run-a").json()
        assert stored["points"] == 2 * 3  # two batches of two layer values and one scalar


def test_closing_replays_the_spool_even_while_the_circuit_is_open(tmp_path: Path, decode: Any) -> None:
    """A collector back before the circuit's next probe still gets the backlog when the process closes."""
    handler = Scripted(httpx.ConnectError("down"))  # one failure, then every request succeeds
    slow_probe = RetryPolicy(max_attempts=1, initial_seconds=30.0, max_seconds=30.0)
    exporter = HttpExporter(
        "http://collector.test/",
        transport=httpx.MockTransport(handler),
        retry=slow_probe,
        spool=DiskSpool(tmp_path, 1 << 20),
    )
    exporter.export(_batch(1))
    exporter.export(_batch(2))  # the circuit is open for 15-30 s: straight to the spool
    exporter.idle()
    assert exporter.counters()["spool_batches"] == 2
    exporter.shutdown()
    exporter.idle()  # the engine's last call while closing
    counts = exporter.counters()
    assert (counts["spool_batches"], counts["replayed_batches"]) == (0, 2)
    assert handler.batch_ids(decode) == ["b1", "b1", "b2"]


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_spools_loudly_once_and_keeps_probing(
    status: int, tmp_path: Path, decode: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """401/403 refuse the token, not the batch: spooled (never dropped), one ERROR line, delivered once accepted."""
    handler = Scripted(status, status)
    spool = DiskSpool(tmp_path, 1 << 20)
    exporter = _exporter(handler, spool)
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        exporter.export(_batch(1))
        exporter.export(_batch(2))  # the circuit is open: straight to the spool
        exporter._not_before = 0.0  # the next probe is due
        exporter.idle()  # refused again
    counts = exporter.counters()
    assert (counts["spooled_batches"], counts["rejected_batches"], counts["dropped_batches"]) == (2, 0, 0)
    assert exporter.failures.counts() == {f"export_refused_{status}": 2}
    (line,) = [r for r in caplog.records if f"export_refused_{status}" in r.getMessage()]
    assert line.levelno == logging.ERROR
    assert "quantwatch replay" in line.getMessage()
    assert exporter.drain(5.0) == 0  # the token is accepted now (the script is exhausted)
    assert handler.batch_ids(decode) == ["b1", "b1", "b1", "b2"]


def test_drain_retries_transient_failures_until_the_spool_is_delivered(tmp_path: Path, decode: Any) -> None:
    """What close() relies on: a collector that is still starting (refused, then 503) gets the spool in order."""
    spool = DiskSpool(tmp_path, 1 << 20)
    handler = Scripted(*[httpx.ConnectError("down")] * 3, httpx.ConnectError("starting"), (503, {}), 200, 503)
    exporter = _exporter(handler, spool)
    exporter.export(_batch(1))
    exporter.export(_batch(2))
    assert len(spool) == 2
    assert exporter.drain(30.0) == 0
    assert handler.batch_ids(decode)[3:] == ["b1", "b1", "b1", "b2", "b2"]
    assert exporter.counters()["replayed_batches"] == 2


def test_drain_gives_up_at_its_timeout_and_keeps_the_spool(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down")

    spool = DiskSpool(tmp_path, 1 << 20)
    exporter = HttpExporter("http://c.test", transport=httpx.MockTransport(refuse), retry=FAST, spool=spool)
    exporter.export(_batch(1))
    assert exporter.drain(0.2) == 1
    assert len(spool) == 1


def test_the_probe_interval_is_capped_whatever_the_retry_policy(tmp_path: Path) -> None:
    """A collector that is back is noticed within MAX_PROBE_INTERVAL_SECONDS, even with minutes of backoff."""
    from quantwatch.agent.exporters import MAX_PROBE_INTERVAL_SECONDS

    handler = Scripted(*[httpx.ConnectError("down")] * 20)
    patient = RetryPolicy(max_attempts=1, initial_seconds=60.0, max_seconds=600.0)
    exporter = HttpExporter(
        "http://c.test", transport=httpx.MockTransport(handler), retry=patient, spool=DiskSpool(tmp_path, 1 << 20)
    )
    for step in range(10):
        exporter.export(_batch(step))
        assert exporter._not_before - time.monotonic() <= MAX_PROBE_INTERVAL_SECONDS
        exporter._not_before = 0.0  # probe at once, failing again: the backoff grows, the cap holds


@pytest.mark.parametrize(
    ("reply", "message"),
    [(401, "refuses this token"), (403, "lacks the 'ingest' scope"), (204, None), (405, None), (None, None)],
    ids=["401", "403", "allowed", "older-collector", "unreachable"],
)
def test_check_token_raises_only_for_a_refused_or_under_scoped_token(reply: int | None, message: str | None) -> None:
    from quantwatch.agent.errors import ConfigError

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.method == "HEAD"
        assert request.url.path == "/api/v1/ingest"
        if reply is None:
            raise httpx.ConnectError("down")
        return httpx.Response(reply)

    exporter = HttpExporter("http://c.test", token="t", transport=httpx.MockTransport(answer))
    if message is None:
        exporter.check_token("token")
        return
    with pytest.raises(ConfigError, match=message) as raised:
        exporter.check_token("QUANTWATCH_TOKEN")
    assert raised.value.field == "QUANTWATCH_TOKEN"
