"""Fixtures of the alerting tests: databases, loopback webhook receivers and a real Alertmanager."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from quantwatch.service import Settings
from quantwatch.service.core.db import make_engine
from quantwatch.service.server import free_port, wait_until_ready


class Receiver:
    """A webhook receiver on loopback that records each request; ``answer`` picks the status code."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.answers: list[tuple[int, dict[str, str]]] = []
        # (webhook-id, status code, body) of each request, in the order the answers were handed out: requests arrive
        # concurrently, so ``requests`` (recorded once answered) need not be in that order.
        self.answered: list[tuple[str, int, bytes]] = []
        self.arrived = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with owner.arrived:
                    code, headers = owner.answers.pop(0) if owner.answers else (204, {})
                    owner.answered.append((self.headers.get("webhook-id", ""), code, body))
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", "0")
                self.end_headers()
                with owner.arrived:
                    owner.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    owner.arrived.notify_all()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, count: int, timeout: float = 20.0) -> list[tuple[dict[str, str], bytes]]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < count and time.monotonic() < deadline:
                self.arrived.wait(deadline - time.monotonic())
            return list(self.requests)


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """An engine (configured like the collector's) on this test's empty, migrated database (SQLite, PostgreSQL)."""
    db = make_engine(Settings(database_url=database_url))
    yield db
    db.dispose()


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    """Factory of loopback receivers (``start=False`` leaves the port closed: the receiver is down)."""
    made: list[Receiver] = []

    def make(*, start: bool = True) -> Receiver:
        receiver = Receiver()
        made.append(receiver)
        return receiver.start() if start else receiver

    yield make
    for receiver in made:
        receiver.stop()


@pytest.fixture
def whsec() -> Callable[[], str]:
    """Factory of fresh Standard Webhooks secrets."""
    return new_secret


ALERTMANAGER_CONFIG = """\
route:
  receiver: hook
  group_by: [alertname, run, layer]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {url}
        send_resolved: true
"""


@pytest.fixture
def alertmanager(tmp_path: Path, receivers: Callable[..., Receiver]) -> Iterator[tuple[str, Receiver]]:
    """A real Alertmanager on loopback routing every alert to a webhook receiver; yields (base URL, receiver)."""
    binary = shutil.which("alertmanager") or shutil.which("prometheus-alertmanager")
    if binary is None:
        pytest.fail("the alertmanager binary is missing: install the Debian package prometheus-alertmanager")
    hook = receivers()
    config = tmp_path / "alertmanager.yml"
    config.write_text(ALERTMANAGER_CONFIG.format(url=hook.url))
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, f"{base}/-/ready", 20, "alertmanager")
        yield base, hook
    finally:
        process.terminate()
        process.wait(10)
