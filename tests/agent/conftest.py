"""Shared fixtures of the agent tests: a decoder of the wire format written independently of the agent's encoder,
and a small scripted HTTP collector on loopback."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import numpy as np
import pytest


def decode_body(body: bytes, content_type: str, content_encoding: str | None) -> dict[str, Any]:
    """Decode an ingest body into plain Python: metric values as lists of float/None, non-finite as floats."""
    if content_encoding == "gzip":
        body = gzip.decompress(body)
    if content_type == "application/json":
        doc = json.loads(body)
        special = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}

        def fix(v: Any) -> Any:
            return special[v] if isinstance(v, str) else v

        for step in doc["steps"]:
            step["metrics"] = {k: [fix(v) for v in vs] for k, vs in step["metrics"].items()}
            step["scalars"] = {k: fix(v) for k, v in step["scalars"].items()}
        return doc
    assert content_type == "application/msgpack"
    doc = msgpack.unpackb(body, raw=False)
    n = len(doc["layers"])
    for step in doc["steps"]:
        for k, vs in step["metrics"].items():
            if isinstance(vs, bytes):
                assert len(vs) == 4 * n
                step["metrics"][k] = [float(v) for v in np.frombuffer(vs, dtype="<f4")]
    return doc


class ScriptedCollector:
    """A real HTTP server on 127.0.0.1: answers ``POST /api/v1/ingest`` from a script of (status, headers) replies
    (200 with points once the script is exhausted) and records every request it got."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str]]] = []
        self.requests: list[dict[str, Any]] = []
        self.connections: set[tuple[str, int]] = set()
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with collector.lock:
                    collector.connections.add(self.client_address)
                    reply = collector.script.pop(0) if collector.script else (200, {})
                    doc = decode_body(body, self.headers["Content-Type"], self.headers.get("Content-Encoding"))
                    collector.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "doc": doc, "status": reply[0]}
                    )
                status, headers = reply
                payload = json.dumps({"batch_id": doc["batch_id"], "duplicate": False, "points": 0}).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def accepted(self) -> list[dict[str, Any]]:
        """Documents of the requests answered with 2xx, in arrival order."""
        with self.lock:
            return [r["doc"] for r in self.requests if 200 <= r["status"] < 300]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def decode() -> Callable[..., dict[str, Any]]:
    """The independent decoder of ingest bodies."""
    return decode_body


@pytest.fixture
def scripted_collector() -> Iterator[ScriptedCollector]:
    collector = ScriptedCollector()
    yield collector
    collector.close()


def _wait_until(predicate: Callable[[], bool], timeout_seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def wait_until() -> Callable[..., bool]:
    """Poll a predicate until it holds or the timeout passes."""
    return _wait_until
