"""Real collector processes: a restart mid-episode, and two replicas on one PostgreSQL ingesting the same run (one
firing layer, retried through the other replica; many firing layers, every rank at once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from quantwatch.service.server import free_port, serve_command, wait_until_ready

pytestmark = pytest.mark.slow


class Collector:
    """``quantwatch serve`` in a subprocess."""

    def __init__(self, database_url: str, rules: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "QUANTWATCH_ALERT_RETRY_BASE_SECONDS": "0.05", "QUANTWATCH_ALERT_RETRY_MAX_SECONDS": "0.5"}
        command = serve_command(self.port, database_url, rules)
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until_ready(self.process, f"{self.url}/healthz", 60, "collector")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def collectors(database_url: str) -> Iterator[Callable[[Path], Collector]]:
    started: list[Collector] = []

    def start(rules: Path) -> Collector:
        collector = Collector(database_url, rules)
        started.append(collector)
        return collector

    yield start
    for collector in started:
        collector.kill()


def rules_file(tmp_path: Path, hook_url: str) -> Path:
    path = tmp_path / "rules.yml"
    path.write_text(
        "default_rules: false\n"
        f"receivers:\n  - {{name: hook, url: '{hook_url}'}}\n"
        "rules:\n  - {name: drift, metric: output_rel_l2, op: '>', threshold: 0.05, consecutive: 3}\n"
    )
    return path


def post(url: str, run: str, rank: int, step: int, value: float, batch_id: str | None = None) -> None:
    body = {
        "run": run,
        "rank": rank,
        "batch_id": batch_id or f"{run}-{rank}-{step}",
        "layers": ["l0", "l1"],
        "steps": [{"step": step, "time": 1.7e9 + step, "metrics": {"output_rel_l2": [value, 0.0]}}],
    }
    answer = httpx.post(f"{url}/api/v1/ingest", json=body, timeout=30)
    assert answer.status_code == 200, answer.text


def wait_delivered(url: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while True:
        log = httpx.get(f"{url}/api/v1/deliveries", timeout=10).json()
        if sum(d["status"] == "delivered" for d in log) >= count or time.monotonic() > deadline:
            return list(log)
        time.sleep(0.05)


def test_restart_mid_episode_fires_once(
    tmp_path: Path, collectors: Callable[[Path], Collector], receivers: Callable[..., Any]
) -> None:
    hook = receivers()
    rules = rules_file(tmp_path, hook.url)
    first = collectors(rules)
    post(first.url, "run", 0, 1, 0.5)
    post(first.url, "run", 0, 2, 0.5)
    first.kill()  # pending (streak 2) when the process dies
    second = collectors(rules)
    post(second.url, "run", 0, 3, 0.5)  # fires
    post(second.url, "run", 0, 4, 0.5)
    assert len(wait_delivered(second.url, 1)) == 1
    second.kill()  # firing when the process dies
    third = collectors(rules)
    post(third.url, "run", 0, 5, 0.5)
    post(third.url, "run", 0, 3, 0.5, batch_id="late-retry")  # an old step: stored, no rewind
    post(third.url, "run", 0, 6, 0.0)  # resolves
    log = wait_delivered(third.url, 2)
    time.sleep(0.3)
    statuses = [json.loads(body)["status"] for _, body in hook.requests]
    assert statuses == ["firing", "resolved"]
    assert len({headers["webhook-id"] for headers, _ in hook.requests}) == 2
    assert sorted(d["event"] for d in log) == ["firing", "resolved"]
    episodes = httpx.get(f"{third.url}/api/v1/alerts").json()
    assert [(e["state"], e["pending"]["step"], e["firing"]["step"], e["resolved"]["step"]) for e in episodes] == [
        ("resolved", 1, 3, 6)
    ]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_two_replicas_on_one_postgres_make_one_episode(
    tmp_path: Path, collectors: Callable[[Path], Collector], receivers: Callable[..., Any]
) -> None:
    hook = receivers()
    rules = rules_file(tmp_path, hook.url)
    replicas = [collectors(rules), collectors(rules)]

    def rank_sends(rank: int, steps: range, value: float) -> None:
        for step in steps:
            own = replicas[(rank + step) % 2]
            other = replicas[(rank + step + 1) % 2]
            post(own.url, "shared", rank, step, value)
            post(other.url, "shared", rank, step, value)  # the same batch retried through the other replica

    for steps, value in ((range(1, 7), 0.5), (range(7, 10), 0.0)):
        threads = [threading.Thread(target=rank_sends, args=(rank, steps, value)) for rank in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    wait_delivered(replicas[0].url, 2)
    time.sleep(0.5)
    statuses = sorted(json.loads(body)["status"] for _, body in hook.requests)
    assert statuses == ["firing", "resolved"]
    assert len({headers["webhook-id"] for headers, _ in hook.requests}) == 2
    for replica in replicas:
        episodes = httpx.get(f"{replica.url}/api/v1/alerts", params={"run": "shared"}).json()
        assert len(episodes) == 1
        assert episodes[0]["state"] == "resolved"
        assert episodes[0]["layer"] == "l0"
        assert episodes[0]["ranks"] == [0, 1, 2, 3]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_two_replicas_open_one_episode_per_firing_layer(
    tmp_path: Path, collectors: Callable[[Path], Collector], receivers: Callable[..., Any]
) -> None:
    # Issue 21's two replicas on one PostgreSQL: ranks alternate between them, every rank posts the same step at
    # once (a barrier per step), in the agent's binary encoding; a third of the layers cross the rule in every rank.
    rules = rules_file(tmp_path, receivers().url)
    replicas = [collectors(rules), collectors(rules)]
    layers = [f"l{i}" for i in range(48)]
    firing = set(layers[::3])
    values = np.array([0.5 if layer in firing else 0.01 for layer in layers], dtype="<f4").tobytes()
    ranks = 6
    barrier = threading.Barrier(ranks)
    failures: list[str] = []

    def rank_sends(rank: int) -> None:
        for step in range(1, 6):
            body = {
                "run": "wide",
                "rank": rank,
                "batch_id": f"wide-{rank}-{step}",
                "layers": layers,
                "steps": [{"step": step, "time": 1.7e9 + step, "metrics": {"output_rel_l2": values}}],
            }
            barrier.wait()
            answer = httpx.post(
                f"{replicas[(rank + step) % 2].url}/api/v1/ingest",
                content=msgpack.packb(body),
                headers={"Content-Type": "application/msgpack"},
                timeout=60,
            )
            if answer.status_code != 200:
                failures.append(answer.text)

    threads = [threading.Thread(target=rank_sends, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    for replica in replicas:
        episodes = httpx.get(f"{replica.url}/api/v1/alerts", params={"run": "wide"}).json()
        assert sorted(e["layer"] for e in episodes) == sorted(firing)  # one each, none on a healthy layer
        assert {e["state"] for e in episodes} == {"firing"}
        assert all(e["ranks"] == list(range(ranks)) for e in episodes)
