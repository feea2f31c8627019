"""``quantwatch serve`` as a real subprocess on both backends."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from quantwatch.service.server import free_port


def test_quantwatch_serve_answers_on_loopback(database_url: str) -> None:
    port = free_port()
    env = {**os.environ, "QUANTWATCH_PORT": str(port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantwatch.cli", "serve", "--database-url", database_url, "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "collector did not start"
                time.sleep(0.2)
        assert r.status_code == 200
        assert r.json() == {"status": "ready"}
        body = b'{"run": "cli", "batch_id": "1", "layers": ["a"], "steps": [{"step": 0, "metrics": {"m": [1.5]}}]}'
        ok = httpx.post(
            f"http://127.0.0.1:{port}/api/v1/ingest", content=body, headers={"Content-Type": "application/json"}
        )
        assert ok.json() == {"batch_id": "1", "duplicate": False, "points": 1}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
