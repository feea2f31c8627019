"""Run the collector on uvicorn in a background thread (tests, the demo's in-process collector), or start one as a
process and wait until it answers (benchmarks, restart tests)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

import httpx
import uvicorn
from fastapi import FastAPI


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class BackgroundServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; ``url`` is its base URL once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.app = app
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"collector:{self.port}", daemon=True)

    def start(self, timeout_seconds: float = 20.0) -> BackgroundServer:
        """Start serving; raise RuntimeError if it is not accepting connections within the timeout."""
        self._thread.start()
        deadline = time.monotonic() + timeout_seconds
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"collector did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout_seconds)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve_command(port: int, database_url: str, rules: Path, log_level: str = "warning") -> list[str]:
    """The command line of a ``quantwatch serve`` process on loopback ``port``, run by this Python interpreter."""
    return [
        sys.executable,
        "-m",
        "quantwatch.cli",
        "serve",
        "--port",
        str(port),
        "--database-url",
        database_url,
        "--rules",
        str(rules),
        "--log-level",
        log_level,
    ]


def wait_until_ready(process: subprocess.Popen[bytes], url: str, timeout_seconds: float, name: str) -> None:
    """Poll ``url`` until it answers 200; raise RuntimeError naming ``name`` (with the tail of the process's
    piped stderr) if ``process`` exits first or ``timeout_seconds`` pass."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"{name} did not start: {err[-2000:]}")
        time.sleep(0.1)
