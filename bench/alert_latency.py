"""Alert latency: from the 200 answer to the ingest of the third breaching step to the webhook arriving.

Starts a real collector (``quantwatch serve`` in a subprocess, SQLite by default) with one rule
(``output_rel_l2 > 0.05`` for 3 consecutive steps) and a webhook receiver on loopback in this process, then:

1. measures the collector's maximum ingest throughput (closed loop, several client threads, batches that are
   evaluated by the rule but never breach);
2. replays ``--episodes`` episodes one after the other (steps 1, 2, 3 breaching on a fresh run each) while background
   clients keep ingesting at ``--load-fraction`` of that maximum, and records, per episode, the time from the 200
   answer to step 3 to the firing webhook's arrival (both read from this process's monotonic clock).

Prints p50/p99/max of the latency, the maximum throughput and the throughput achieved during the latency phase.
Usage: ``.venv/bin/python bench/alert_latency.py [--episodes 200] [--database-url URL]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from quantwatch.service.server import free_port, serve_command, wait_until_ready

LAYERS = [f"blocks.{i // 4}.{['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2'][i % 4]}" for i in range(64)]


class Hook:
    """Loopback webhook receiver: records the arrival time of each firing notification by run."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.events: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                arrived = time.perf_counter()
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()
                payload = json.loads(body)
                if payload["status"] == "firing":
                    run = payload["quantwatch"]["run"]
                    with owner.lock:
                        owner.arrivals.setdefault(run, arrived)
                        event = owner.events.setdefault(run, threading.Event())
                    event.set()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, run: str, timeout: float) -> float | None:
        with self.lock:
            event = self.events.setdefault(run, threading.Event())
        if not event.wait(timeout):
            return None
        return self.arrivals[run]


def batch(run: str, step: int, value: float, layers: list[str], batch_id: str) -> dict[str, Any]:
    return {
        "run": run,
        "rank": 0,
        "batch_id": batch_id,
        "layers": layers,
        "steps": [
            {
                "step": step,
                "time": time.time(),
                "metrics": {"output_rel_l2": [value] * len(layers), "act_rel_l2": [value] * len(layers)},
            }
        ],
    }


class Load:
    """Background ingest: ``threads`` clients, each on its own run, closed loop or paced to ``rate`` batches/s."""

    def __init__(self, url: str, threads: int, rate: float | None, tag: str) -> None:
        self.url, self.threads, self.rate, self.tag = url, threads, rate, tag
        self.done = 0
        self.errors = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, index: int) -> None:
        run = f"load-{self.tag}-{index}"
        period = self.threads / self.rate if self.rate else 0.0
        next_at = time.perf_counter()
        step = 0
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                step += 1
                answer = client.post(f"{self.url}/api/v1/ingest", json=batch(run, step, 0.01, LAYERS, f"{run}-{step}"))
                with self.lock:
                    if answer.status_code == 200:
                        self.done += 1
                    else:
                        self.errors += 1
                if period:
                    next_at += period
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)

    def start(self) -> float:
        for worker in self.workers:
            worker.start()
        return time.perf_counter()

    def finish(self) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--database-url", default=None, help="default: a fresh SQLite file in a temp folder")
    parser.add_argument("--max-seconds", type=float, default=8.0, help="length of the throughput measurement")
    parser.add_argument("--threads", type=int, default=4, help="load client threads")
    # Paced clients fall slightly short of their target; aim a little above the half the goal asks for.
    parser.add_argument("--load-fraction", type=float, default=0.55)
    args = parser.parse_args()

    hook = Hook()
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "rules.yml"
        rules.write_text(
            "default_rules: false\n"
            f"receivers:\n  - {{name: hook, url: '{hook.url}'}}\n"
            "rules:\n  - {name: drift, metric: output_rel_l2, op: '>', threshold: 0.05, consecutive: 3}\n"
        )
        database_url = args.database_url or f"sqlite:///{tmp}/bench.db"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(serve_command(port, database_url, rules), env=os.environ.copy())
        try:
            wait_until_ready(server, f"{url}/healthz", 60, "collector")

            maximum = Load(url, args.threads, None, "max")
            started = maximum.start()
            time.sleep(args.max_seconds)
            maximum.finish()
            max_rate = maximum.done / (time.perf_counter() - started)

            background = Load(url, args.threads, max_rate * args.load_fraction, "bg")
            bg_started = background.start()
            latencies: list[float] = []
            missed = 0
            with httpx.Client(timeout=30) as client:
                for episode in range(args.episodes):
                    run = f"lat-{episode}"
                    for step in (1, 2, 3):
                        answer = client.post(
                            f"{url}/api/v1/ingest", json=batch(run, step, 0.5, ["blocks.0.attn.qkv"], f"{run}-{step}")
                        )
                        answered = time.perf_counter()
                        if answer.status_code != 200:
                            raise SystemExit(f"ingest failed: {answer.status_code} {answer.text}")
                    arrived = hook.wait(run, timeout=10.0)
                    if arrived is None:
                        missed += 1
                    else:
                        latencies.append(arrived - answered)
            bg_seconds = time.perf_counter() - bg_started
            background.finish()
            bg_rate = background.done / bg_seconds
        finally:
            server.terminate()
            server.wait(20)
            hook.server.shutdown()

    latencies.sort()
    ms = [value * 1000 for value in latencies]
    p99 = ms[max(0, math.ceil(0.99 * len(ms)) - 1)] if ms else float("nan")  # nearest-rank percentile
    print(f"database: {database_url.split(':', 1)[0]}  episodes: {args.episodes}  missed: {missed}")
    print(
        f"max ingest throughput: {max_rate:.1f} batches/s ({max_rate * len(LAYERS) * 2:.0f} points/s, "
        f"{args.threads} client threads, {maximum.errors} errors)"
    )
    print(
        f"background during latency phase: {bg_rate:.1f} batches/s = {bg_rate / max_rate:.2f} × max "
        f"({background.errors} errors)"
    )
    print(
        f"alert latency (200 answer of step 3 → webhook arrival): p50 {statistics.median(ms):.1f} ms, "
        f"p99 {p99:.1f} ms, max {ms[-1]:.1f} ms, min {ms[0]:.1f} ms"
    )
    print(
        f"goal p99 ≤ 250 ms with background ≥ 0.5 × max: "
        f"{'met' if p99 <= 250 and bg_rate >= 0.5 * max_rate and not missed else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
