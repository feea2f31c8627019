"""Ingest: encodings, idempotency, atomicity, last-write-wins, layers added later, bad input."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from tests.service.conftest import HoldingObserver

PROBLEM = "application/problem+json"


def _values(rng: np.random.Generator, steps: int, layers: int) -> np.ndarray:
    return rng.random((steps, layers), dtype=np.float32)


def _heat(client: Any, run: str, metric: str, **params: Any) -> dict[str, Any]:
    r = client.get(f"/api/v1/runs/{run}/heatmap", params={"metric": metric, **params})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.parametrize(
    ("kind", "binary", "gzipped"),
    [("json", False, False), ("json", False, True), ("msgpack", True, False), ("msgpack", False, True)],
)
def test_every_encoding_stores_exact_float32(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any], kind: str, binary: bool, gzipped: bool
) -> None:
    rng = np.random.default_rng(1)
    vals = _values(rng, 3, 4)
    doc = make_batch("enc/run-1", ["l0", "l1", "l2", "l3"], [10, 11, 12], {"output_rel_l2": vals}, binary=binary)
    r = post_batch(doc, kind, gzipped)
    assert r.status_code == 200, r.text
    answer = r.json()
    answer.pop("firing_episodes", None)  # random values: a rule may fire (tests/service/test_actions.py)
    assert answer == {"batch_id": doc["batch_id"], "duplicate": False, "points": 12}
    heat = _heat(client, "enc/run-1", "output_rel_l2")
    assert heat["layers"] == ["l0", "l1", "l2", "l3"]
    assert heat["steps"] == [10, 11, 12]
    np.testing.assert_array_equal(np.array(heat["values"], dtype=np.float32), vals.T)


def test_retried_batch_is_stored_once(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    doc = make_batch("retry", ["a"], [1, 2], {"m": np.array([[1.0], [2.0]])}, scalars={"loss": [3.0, 4.0]})
    first = post_batch(doc)
    second = post_batch(doc, "msgpack")
    assert first.json()["duplicate"] is False
    assert second.status_code == 200
    assert second.json() == {"batch_id": doc["batch_id"], "duplicate": True, "points": 0}
    run = client.get("/api/v1/runs/retry").json()
    assert run["points"] == 4
    series = client.get("/api/v1/runs/retry/series", params={"scalar": "loss"}).json()
    assert series["steps"] == [1, 2]
    assert series["mean"] == [3.0, 4.0]


def test_failed_batch_stores_nothing_and_keeps_earlier(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    good = make_batch("atomic", ["a", "b"], [1], {"m": np.array([[0.5, 0.25]])})
    assert post_batch(good).status_code == 200
    bad = make_batch("atomic", ["a", "b"], [2, 3], {"m": np.array([[1.0, 1.0], [2.0, 2.0]])})
    bad["steps"][1]["metrics"]["m"] = [1.0]  # one value for two layers
    r = post_batch(bad)
    assert r.status_code == 422
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["errors"][0]["field"] == "steps[1].metrics.m"
    assert "length 1 ≠ 2 layers" in r.json()["detail"]
    # The same batch id, fixed, is not a duplicate: nothing of the failed attempt was kept.
    bad["steps"][1]["metrics"]["m"] = [2.0, 2.0]
    again = post_batch(bad)
    assert again.json()["duplicate"] is False
    heat = _heat(client, "atomic", "m")
    assert heat["steps"] == [1, 2, 3]
    assert heat["values"] == [[0.5, 1.0, 2.0], [0.25, 1.0, 2.0]]


def test_observer_failure_rolls_the_batch_back(
    make_app: Callable[..., Any], make_batch: Callable[..., Any], encode_batch: Callable[..., Any]
) -> None:
    from fastapi.testclient import TestClient

    class Exploding:
        def __init__(self) -> None:
            self.committed: list[str] = []

        def on_batch(self, session: Any, run_row: Any, batch: Any) -> None:
            if batch.batch_id == "boom":
                raise RuntimeError("observer failed")

        def after_commit(self, batch: Any) -> None:
            self.committed.append(batch.batch_id)

    observer = Exploding()
    app = make_app()
    app.state.ingest_observers.append(observer)
    with TestClient(app, raise_server_exceptions=False) as client:
        ok = make_batch("obs", ["a"], [1], {"m": np.array([[1.0]])}, batch_id="fine")
        boom = make_batch("obs", ["a"], [2], {"m": np.array([[2.0]])}, batch_id="boom")
        assert (
            client.post("/api/v1/ingest", content=encode_batch(ok)[0], headers=encode_batch(ok)[1]).status_code == 200
        )
        r = client.post("/api/v1/ingest", content=encode_batch(boom)[0], headers=encode_batch(boom)[1])
        assert r.status_code == 500
        assert r.headers["content-type"] == PROBLEM
        assert observer.committed == ["fine"]
        assert client.get("/api/v1/runs/obs").json()["last_step"] == 1


def test_observer_sees_decoded_batch_inside_the_transaction(
    make_app: Callable[..., Any], make_batch: Callable[..., Any], encode_batch: Callable[..., Any]
) -> None:
    from fastapi.testclient import TestClient
    from sqlalchemy import text

    seen: list[tuple[str, int, tuple[str, ...], int, list[float], int]] = []

    class Recorder:
        def on_batch(self, session: Any, run_row: Any, batch: Any) -> None:
            stored = session.execute(text("SELECT count(*) FROM points WHERE run_id = :r"), {"r": run_row.id}).scalar()
            seen.append(
                (
                    run_row.name,
                    batch.rank,
                    batch.layers,
                    batch.steps[0].step,
                    batch.steps[0].metrics["m"].tolist(),
                    stored,
                )
            )

        def after_commit(self, batch: Any) -> None:
            seen.append(("commit", 0, (), 0, [], 0))

    with TestClient(make_app()) as client:
        client.app.state.ingest_observers.append(Recorder())
        doc = make_batch("seen", ["a", "b"], [7], {"m": np.array([[0.5, 0.75]])}, rank=3, binary=True)
        body, headers = encode_batch(doc, "msgpack")
        assert client.post("/api/v1/ingest", content=body, headers=headers).status_code == 200
        assert client.post("/api/v1/ingest", content=body, headers=headers).json()["duplicate"] is True
    assert seen == [("seen", 3, ("a", "b"), 7, [0.5, 0.75], 1), ("commit", 0, (), 0, [], 0)]


def test_resent_points_last_write_wins(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    first = make_batch("lww", ["a", "b"], [1, 2], {"m": np.array([[1.0, 2.0], [3.0, 4.0]])})
    assert post_batch(first).status_code == 200
    # Re-send step 2 under a new batch id: layer a measured anew, layer b not measured (null) keeps its old value.
    again = make_batch("lww", ["a", "b"], [2], {"m": np.array([[9.0, np.nan]])})
    assert post_batch(again).json()["duplicate"] is False
    heat = _heat(client, "lww", "m")
    assert heat["values"] == [[1.0, 9.0], [2.0, 4.0]]
    s = client.get("/api/v1/runs/lww/series", params={"metric": "m", "layer": "a", "max_points": 1}).json()
    assert s["min"] == [1.0]
    assert s["max"] == [9.0]
    assert s["mean"] == [5.0]


def test_step_resent_behind_the_ranks_newest_merges_with_what_is_stored(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    # A batch past its rank's newest step skips looking for stored steps; one behind it must still find them, however
    # far the other ranks have gone.
    assert (
        post_batch(make_batch("behind", ["a", "b"], [1, 2], {"m": np.array([[1.0, 2.0], [3.0, 4.0]])})).status_code
        == 200
    )
    assert post_batch(make_batch("behind", ["a", "b"], [9], {"m": np.array([[7.0, 7.0]])}, rank=1)).status_code == 200
    assert post_batch(make_batch("behind", ["a", "b"], [3], {"m": np.array([[5.0, 6.0]])})).status_code == 200
    again = make_batch("behind", ["a", "b"], [1], {"m": np.array([[9.0, np.nan]])})
    assert post_batch(again).json()["duplicate"] is False
    assert _heat(client, "behind", "m")["values"] == [[9.0, 3.0, 5.0], [2.0, 4.0, 6.0]]
    assert _heat(client, "behind", "m", rank=1)["values"] == [[7.0], [7.0]]


def test_batch_adds_layers_to_known_run(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    assert post_batch(make_batch("grow", ["a", "b"], [1], {"m": np.array([[1.0, 2.0]])})).status_code == 200
    # A later batch names layers in another order and adds one: layers keep first-seen order.
    assert (
        post_batch(
            make_batch("grow", ["c", "a"], [2], {"m": np.array([[3.0, 4.0]])}, binary=True), "msgpack"
        ).status_code
        == 200
    )
    layers = client.get("/api/v1/runs/grow/layers").json()
    unknown = {"formats": None, "format_changes": []}
    assert layers == [{"index": i, "name": name, **unknown} for i, name in enumerate("abc")]
    heat = _heat(client, "grow", "m")
    assert heat["layers"] == ["a", "b", "c"]
    assert heat["values"] == [[1.0, 4.0], [2.0, None], [None, 3.0]]


def test_nonfinite_values_are_stored_as_such(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    doc = make_batch("nonfinite", ["a", "b", "c", "d"], [5], {"m": np.zeros((1, 4))})
    doc["steps"][0]["metrics"]["m"] = ["nan", "inf", "-inf", None]
    doc["steps"][0]["scalars"] = {"loss": "nan"}
    assert post_batch(doc).json()["points"] == 4
    assert _heat(client, "nonfinite", "m")["values"] == [["nan"], ["inf"], ["-inf"], [None]]
    binary = make_batch(
        "nonfinite", ["a", "b", "c", "d"], [6], {"m": np.array([[np.nan, np.inf, -np.inf, 1.0]])}, binary=True
    )
    assert post_batch(binary, "msgpack").status_code == 200
    assert _heat(client, "nonfinite", "m")["values"] == [["nan", "nan"], ["inf", "inf"], ["-inf", "-inf"], [None, 1.0]]
    assert client.get("/api/v1/runs/nonfinite/series", params={"scalar": "loss"}).json()["mean"] == ["nan"]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(run="bad run!"), "run"),
        (lambda d: d.update(rank=-1), "rank"),
        (lambda d: d.update(batch_id=""), "batch_id"),
        (lambda d: d.update(steps=[]), "steps"),
        (lambda d: d["steps"][0].update(step="1"), "steps[0].step"),
        (lambda d: d["steps"][0]["metrics"].update(m=[1.0, "x"]), "steps[0].metrics.m[1]"),
        (lambda d: d["steps"][0]["metrics"].update(m=[True, 1.0]), "steps[0].metrics.m[0]"),
        (lambda d: d["steps"][0]["scalars"].update(loss=[1]), "steps[0].scalars.loss"),
        (lambda d: d.update(layers=["a", "a"]), "layers"),
        (lambda d: d["steps"].append(dict(d["steps"][0])), "steps[1].step"),
    ],
)
def test_schema_violations_are_422_naming_the_field(
    post_batch: Callable[..., Any], make_batch: Callable[..., Any], mutate: Callable[[dict[str, Any]], Any], field: str
) -> None:
    doc = make_batch("schema", ["a", "b"], [1], {"m": np.array([[1.0, 2.0]])}, scalars={"loss": [1.0]})
    mutate(doc)
    r = post_batch(doc)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["type"].endswith("/validation-error")
    assert problem["status"] == 422
    assert problem["errors"][0]["field"] == field


def test_binary_metric_of_wrong_length_is_422(post_batch: Callable[..., Any], make_batch: Callable[..., Any]) -> None:
    doc = make_batch("binlen", ["a", "b"], [1], {"m": np.array([[1.0, 2.0]])}, binary=True)
    doc["steps"][0]["metrics"]["m"] = doc["steps"][0]["metrics"]["m"][:4]
    r = post_batch(doc, "msgpack")
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "steps[0].metrics.m"


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b"{not json", {"Content-Type": "application/json"}),
        (b"\xc1\xc1", {"Content-Type": "application/msgpack"}),
        (b"not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"}),
        (gzip.compress(b'{"run": "x"', mtime=0)[:-6], {"Content-Type": "application/json", "Content-Encoding": "gzip"}),
    ],
)
def test_malformed_bodies_are_400(client: Any, body: bytes, headers: dict[str, str]) -> None:
    r = client.post("/api/v1/ingest", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"].endswith("/bad-request")


@pytest.mark.parametrize(
    "headers",
    [{"Content-Type": "text/plain"}, {}, {"Content-Type": "application/json", "Content-Encoding": "br"}],
)
def test_wrong_content_type_is_415(client: Any, headers: dict[str, str]) -> None:
    r = client.post("/api/v1/ingest", content=b"{}", headers=headers)
    assert r.status_code == 415
    assert r.json()["type"].endswith("/unsupported-media-type")


def test_oversized_body_is_413_before_it_is_read_whole(start_collector: Callable[..., Any]) -> None:
    server = start_collector(max_body_bytes=4096)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        declared = http.post("/api/v1/ingest", content=b"x" * 8192, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413
        assert declared.headers["content-type"] == PROBLEM
    # A chunked upload without Content-Length: send 8 KiB of a body that never ends and read the answer; it must
    # come while the body is still incomplete (the server stopped reading at the limit).
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(8):
            sock.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"application/problem+json" in answer


def test_gzip_bomb_is_413(make_app: Callable[..., Any]) -> None:
    from fastapi.testclient import TestClient

    with TestClient(make_app(max_decoded_bytes=1 << 20)) as client:
        body = gzip.compress(b" " * (8 << 20))
        r = client.post(
            "/api/v1/ingest", content=body, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}
        )
        assert r.status_code == 413


def test_live_ingest_over_http(
    live_collector: Any, make_batch: Callable[..., Any], encode_batch: Callable[..., Any]
) -> None:
    doc = make_batch("live/1", ["x"], [0, 1], {"m": np.array([[0.25], [0.5]])}, binary=True)
    body, headers = encode_batch(doc, "msgpack", gzipped=True)
    with httpx.Client(base_url=live_collector.url) as http:
        r = http.post("/api/v1/ingest", content=body, headers=headers)
        assert r.status_code == 200
        assert r.json()["points"] == 2
        s = http.get("/api/v1/runs/live/1/series", params={"metric": "m", "layer": "x"}).json()
    assert s == {
        "steps": [0, 1],
        "min": [0.25, 0.5],
        "mean": [0.25, 0.5],
        "max": [0.25, 0.5],
        "bucket_steps": 1,
        "estimated": [],
    }
    assert json.loads(json.dumps(s)) == s


def test_nul_characters_are_refused_not_crashed(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    doc = make_batch("nul", ["a\x00b"], [0], {"m": np.ones((1, 1))})
    r = post_batch(doc)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "layers[0]"
    doc = make_batch("nul", ["a"], [0], {"m": np.ones((1, 1))}, batch_id="id\x00")
    r = post_batch(doc)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "batch_id"
    assert client.get("/api/v1/runs/nul").status_code == 404  # nothing of the refused batches was stored
    q = client.get("/api/v1/runs/nul/series", params={"metric": "m\x00", "layer": "a"})
    assert q.status_code == 422
    assert q.json()["errors"][0]["field"] == "query.metric"


def test_ingest_beyond_the_pending_limit_gets_429_with_retry_after_and_loses_nothing(
    make_app: Callable[..., Any], make_batch: Callable[..., Any], encode_batch: Callable[..., Any]
) -> None:
    """Over real HTTP: with one request held, a second is refused with 429 + Retry-After before its body is stored;
    once the first is through, the second is accepted and both batches are stored exactly once."""
    from quantwatch.service.server import BackgroundServer

    held = make_batch("gate", ["a"], [1], {"m": np.array([[1.0]])}, batch_id="held")
    second = make_batch("gate", ["a"], [2], {"m": np.array([[2.0]])}, batch_id="second")
    app = make_app(max_pending_ingest=1)
    holding = HoldingObserver("held")
    app.state.ingest_observers.append(holding)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        outcome: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: outcome.append(
                http.post("/api/v1/ingest", content=encode_batch(held)[0], headers=encode_batch(held)[1])
            )
        )
        sender.start()
        assert holding.entered.wait(30)
        with httpx.Client(base_url=server.url, timeout=30) as other:
            refused = other.post("/api/v1/ingest", content=encode_batch(second)[0], headers=encode_batch(second)[1])
            assert refused.status_code == 429
            assert refused.headers["content-type"] == PROBLEM
            assert refused.json()["status"] == 429
            assert 1 <= int(refused.headers["retry-after"]) <= 30
            holding.release.set()
            sender.join(30)
            assert [r.status_code for r in outcome] == [200]
            accepted = other.post("/api/v1/ingest", content=encode_batch(second)[0], headers=encode_batch(second)[1])
            assert accepted.json() == {"batch_id": "second", "duplicate": False, "points": 1}
            assert other.get("/api/v1/runs/gate").json()["points"] == 2
            assert 'quantwatch_ingest_requests_total{outcome="throttled"} 1.0' in other.get("/metrics").text


class _HeldAfterCommit:
    """An ingest observer that holds every stored batch's worker thread after its commit until released, counting
    how many it holds at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0
        self.release = threading.Event()

    def on_batch(self, session: Any, run_row: Any, batch: Any) -> None:
        pass

    def after_commit(self, batch: Any) -> None:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            assert self.release.wait(30), "the test never released the batches"
        finally:
            with self.lock:
                self.active -= 1


@pytest.mark.parametrize("threads", [2, None])
def test_ingest_threads_bound_the_requests_stored_at_once(
    threads: int | None,
    database_url: str,
    make_app: Callable[..., Any],
    make_batch: Callable[..., Any],
    encode_batch: Callable[..., Any],
) -> None:
    """Over real HTTP, 6 requests at once: with ``ingest_threads`` 2 two are stored at a time and the others wait
    their turn, all stored in the end; unset, 4 at a time on PostgreSQL and all 6 on SQLite (its group commit queues
    them itself)."""
    from quantwatch.service.server import BackgroundServer

    app = make_app(ingest_threads=threads)
    held = _HeldAfterCommit()
    app.state.ingest_observers.append(held)
    expected = threads or (4 if database_url.startswith("postgresql") else 6)
    docs = [make_batch("threads", ["a"], [1], {"m": np.array([[float(r)]])}, rank=r) for r in range(6)]
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        answers: list[int] = []

        def send(doc: dict[str, Any]) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as own:
                body, headers = encode_batch(doc)
                answers.append(own.post("/api/v1/ingest", content=body, headers=headers).status_code)

        senders = [threading.Thread(target=send, args=(doc,)) for doc in docs]
        for sender in senders:
            sender.start()
        try:
            deadline = time.monotonic() + 20
            while held.active < expected and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # time for a request past the bound to come through, were there none
            assert held.active == expected
            assert held.most == expected
        finally:
            held.release.set()
            for sender in senders:
                sender.join(30)
        assert answers == [200] * 6
        assert http.get("/api/v1/runs/threads").json()["points"] == 6


@pytest.mark.parametrize("value", [0, -3, 1025, "many"])
def test_a_bad_ingest_threads_names_the_setting(value: object) -> None:
    from pydantic import ValidationError

    from quantwatch.service.core.config import Settings

    with pytest.raises(ValidationError, match="ingest_threads"):
        Settings(ingest_threads=value)


@pytest.mark.parametrize("value", [0, -1.0, "hour", True])
def test_a_bad_states_ttl_names_the_argument(value: object) -> None:
    from quantwatch.service.alerts.engine import AlertEngine

    with pytest.raises(ValueError, match="states_ttl_seconds"):
        AlertEngine(external_url="http://x", delivery_horizon_seconds=60, states_ttl_seconds=value)  # type: ignore[arg-type]


def test_a_stalled_upload_gets_408_and_frees_its_slot(
    make_app: Callable[..., Any], make_batch: Callable[..., Any], encode_batch: Callable[..., Any]
) -> None:
    """A client that sends headers and part of its body, then stalls, is answered 408 problem+json after the read
    timeout, and the ingest slot it held is free again (the gate allows one request at a time here)."""
    from quantwatch.service.server import BackgroundServer

    app = make_app(max_pending_ingest=1, ingest_read_timeout_seconds=0.5)
    doc = make_batch("stall", ["a"], [1], {"m": np.array([[1.0]])})
    body, headers = encode_batch(doc)
    with BackgroundServer(app) as server:
        with socket.create_connection((server.host, server.port), timeout=30) as stalled:
            head = (
                f"POST /api/v1/ingest HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: {headers['Content-Type']}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            stalled.sendall(head.encode() + body[: len(body) // 2])
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = stalled.recv(65536)
                if not chunk:
                    break
                answer += chunk
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.split()[1] == b"408", answer
        assert b"application/problem+json" in rest.lower()
        assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["status"] == 408
        with httpx.Client(base_url=server.url, timeout=30) as http:
            stored = http.post("/api/v1/ingest", content=body, headers=headers)
            assert stored.status_code == 200, stored.text
            assert http.get("/api/v1/runs/stall").json()["points"] == 1
