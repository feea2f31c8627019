"""Issue 20: figures a job never delivers.  A real collector process on a SQLite file, SIGKILLed and started again
on the same port and database while jobs train; a collector still down at close; a refused token.
Afterwards every step of every layer is stored exactly once and no spool holds anything.

One collector process (with tokens) serves the whole module, so the module pays for three collector starts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import quantwatch.agent as qw
from quantwatch.agent.destination import spool_directory
from quantwatch.agent.spool import DiskSpool
from quantwatch.cli import app
from quantwatch.client import ExitCode
from quantwatch.kernels import QuantConfig, Recipe, quantize_model
from quantwatch.service.server import free_port, wait_until_ready

INGEST_TOKEN = "outage-ingest-token"
READ_ONLY_TOKEN = "outage-read-token"
STEPS = 120
FAST_RETRY = qw.RetryPolicy(max_attempts=2, initial_seconds=0.02, max_seconds=0.5)
OPTIONS: dict[str, Any] = {"every": 1, "flush_interval_seconds": 0.2, "retry": FAST_RETRY, "max_batch_steps": 8}


# The collector process: a parent that imported the collector once forks a fresh child per (re)start, so a restart
# costs the app's start-up (migration check, rules, uvicorn) and not the imports (seconds on a loaded machine).
ZYGOTE = """
import json, os, signal, sys
import uvicorn
from quantwatch.service import Settings, create_app
settings = json.loads(sys.argv[1])
child = 0
for line in sys.stdin:
    if child:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        child = 0
    if line.strip() == "stop":
        break
    if line.strip() == "down":
        print(0, flush=True)
        continue
    child = os.fork()
    if child == 0:
        app = create_app(Settings(**settings))
        uvicorn.run(app, host=settings["host"], port=settings["port"], log_level="warning", access_log=False)
        os._exit(0)
    print(child, flush=True)
"""


class CollectorProcess:
    """A real collector (uvicorn, SQLite file) in a child process; ``restart()`` SIGKILLs it and starts it again on
    the same port and database."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {
            "database_url": f"sqlite:///{tmp_path / 'collector.db'}",
            "host": "127.0.0.1",
            "port": self.port,
            "tokens": {INGEST_TOKEN: ["ingest", "read"], READ_ONLY_TOKEN: ["read"]},
        }
        self.parent = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.restart()
        self.wait_ready()

    def wait_ready(self) -> None:
        wait_until_ready(self.parent, f"{self.url}/healthz", 60, "collector")

    def restart(self) -> None:
        """SIGKILL the collector (if one runs), then start it again without waiting for it to answer."""
        self._tell(b"restart\n")

    def down(self) -> None:
        """SIGKILL the collector and leave it down until `restart`."""
        self._tell(b"down\n")

    def _tell(self, line: bytes) -> None:
        assert self.parent.stdin is not None
        assert self.parent.stdout is not None
        self.parent.stdin.write(line)
        self.parent.stdin.flush()
        self.parent.stdout.readline()

    def kill(self) -> None:
        assert self.parent.stdin is not None
        self.parent.stdin.write(b"stop\n")
        self.parent.stdin.close()
        self.parent.wait(10)

    def get(self, path: str, **params: Any) -> Any:
        headers = {"Authorization": f"Bearer {INGEST_TOKEN}"}
        response = httpx.get(f"{self.url}{path}", params=params, headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def stored_steps(self, run: str, layers: tuple[str, ...]) -> dict[str, list[int]]:
        """Steps stored per layer (its output_rel_l2) and for the loss scalar."""
        out = {"loss": self.get(f"/api/v1/runs/{run}/series", scalar="loss", max_points=10_000)["steps"]}
        for layer in layers:
            series = self.get(f"/api/v1/runs/{run}/series", metric="output_rel_l2", layer=layer, max_points=10_000)
            out[layer] = series["steps"]
        return out

    def points(self, run: str) -> int:
        runs = {r["name"]: r for r in self.get("/api/v1/runs")}
        return int(runs[run]["points"])


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    process = CollectorProcess(tmp_path_factory.mktemp("outage"))
    yield process
    process.kill()


class CountingExporter(qw.HttpExporter):
    """The HTTP exporter, counting the points the agent produced."""

    produced_points = 0

    def export(self, batch: qw.Batch) -> None:
        self.produced_points += batch.point_count()
        super().export(batch)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return quantize_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), Recipe(default=QuantConfig()))


def _train(model: nn.Module, monitor: qw.Monitor, steps: range, pause: Any = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in steps:
        if pause is not None:
            pause(step)
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, loss=loss)


def _job(collector: CollectorProcess, run: str, spool: Path) -> tuple[nn.Module, qw.Monitor, CountingExporter]:
    exporter = CountingExporter(collector.url, token=INGEST_TOKEN, retry=FAST_RETRY, spool=DiskSpool(spool, 1 << 24))
    model = _model()
    return model, qw.attach(model, run=run, exporter=exporter, **OPTIONS), exporter


def test_two_collector_kills_while_fast_and_slow_jobs_train_lose_and_duplicate_nothing(
    collector: CollectorProcess, tmp_path: Path
) -> None:
    """The measured failure: kill -9 and restart twice mid-run, close() while the collector is (re)starting.

    The collector stays down until the jobs it kills have spooled a batch: a forked collector is back within a
    fraction of a second, which a job on a loaded machine may not post in."""
    first_outage = threading.Barrier(3, action=collector.down)  # both jobs at step 40, then the first kill
    second_outage = threading.Barrier(2, action=collector.down)  # the slow job at step 100, then the second
    back = threading.Event()
    results: dict[str, Any] = {}
    monitors: dict[str, qw.Monitor] = {}

    def restart_once_spooled(names: tuple[str, ...], before: dict[str, int]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
            name not in monitors or monitors[name].stats()["spooled_batches"] <= before.get(name, 0) for name in names
        ):
            time.sleep(0.01)
        collector.restart()
        collector.wait_ready()

    def fast_pause(step: int) -> None:
        if step == 40:
            first_outage.wait(60)

    def slow_pause(step: int) -> None:
        if step == 40:
            first_outage.wait(60)
        if step == 80:
            back.wait(60)  # steps 80–99 run while the restarted collector answers
        if step == 100:
            second_outage.wait(60)
        time.sleep(0.02)

    def run(name: str, pause: Any) -> None:
        model, monitor, exporter = _job(collector, name, tmp_path / name)
        monitors[name] = monitor
        _train(model, monitor, range(STEPS), pause)
        results[name] = (monitor.close(60), monitor.stats(), exporter, monitor.layers)

    jobs = [threading.Thread(target=run, args=(n, p)) for n, p in (("fast", fast_pause), ("slow", slow_pause))]
    for job in jobs:
        job.start()
    first_outage.wait(60)
    restart_once_spooled(("fast", "slow"), {})
    back.set()
    spooled = {"slow": monitors["slow"].stats()["spooled_batches"]}
    second_outage.wait(60)
    restart_once_spooled(("slow",), spooled)
    for job in jobs:
        job.join(120)
    for name in ("fast", "slow"):
        result, stats, exporter, layers = results[name]
        assert result.delivered, (name, result, stats)
        assert (stats["spool_batches"], stats["dropped_batches"], stats["rejected_batches"]) == (0, 0, 0), stats
        assert stats["spooled_batches"] > 0, (name, stats)  # the outages did reach this job
        stored = collector.stored_steps(name, layers)
        assert all(steps == list(range(STEPS)) for steps in stored.values()), (name, stored)
        assert collector.points(name) == exporter.produced_points  # exactly once: nothing stored twice
        assert not list((tmp_path / name).iterdir())


def test_collector_down_at_close_keeps_everything_and_replay_delivers_it(
    collector: CollectorProcess, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    dead = qw.HttpExporter(f"http://127.0.0.1:{free_port()}", retry=FAST_RETRY, spool=DiskSpool(spool, 1 << 24))
    model = _model()
    monitor = qw.attach(model, run="down-at-close", exporter=dead, **OPTIONS)
    _train(model, monitor, range(30))
    result = monitor.close(1.0)
    assert result.finished
    assert not result.delivered
    assert result.spool_batches == monitor.stats()["spool_batches"] == monitor.stats()["spooled_batches"] > 0
    runner = CliRunner()
    refused = runner.invoke(app, ["replay", str(tmp_path), "--url", collector.url, "--token", "wrong"])
    assert refused.exit_code == ExitCode.AUTH, refused.output
    assert len(list(spool.iterdir())) == result.spool_batches  # nothing removed that was not stored
    replayed = runner.invoke(app, ["replay", str(tmp_path), "--url", collector.url, "--token", INGEST_TOKEN])
    assert replayed.exit_code == 0, replayed.output
    assert f"{result.spool_batches} batches" in replayed.output
    assert not list(spool.iterdir())
    stored = collector.stored_steps("down-at-close", monitor.layers)
    assert all(steps == list(range(30)) for steps in stored.values()), stored
    again = runner.invoke(app, ["replay", str(tmp_path), "--url", collector.url, "--token", INGEST_TOKEN])
    assert again.exit_code == 0, again.output
    assert "0 batches" in again.output


def test_a_refused_token_loses_nothing_and_the_next_process_with_the_right_token_delivers(
    collector: CollectorProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = "wrong-token"
    directory = spool_directory(tmp_path, run, 0)
    wrong = CountingExporter(collector.url, token="wrong", retry=FAST_RETRY, spool=DiskSpool(directory, 1 << 24))
    model = _model()
    monitor = qw.attach(model, run=run, exporter=wrong, **OPTIONS)
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        _train(model, monitor, range(20))
        result = monitor.close(2.0)
    stats = monitor.stats()
    assert (stats["rejected_batches"], stats["dropped_batches"]) == (0, 0)
    assert result.spool_batches == stats["spooled_batches"] > 0
    refusals = [r for r in caplog.records if "export_refused_401" in r.getMessage()]
    assert len(refusals) == 1
    assert refusals[0].levelno == logging.ERROR
    assert str(directory) in refusals[0].getMessage()

    with pytest.raises(qw.ConfigError) as refused:
        qw.attach(_model(), run=run, url=collector.url, token="wrong", spool_dir=tmp_path, **OPTIONS)
    assert refused.value.field == "token"
    with pytest.raises(qw.ConfigError, match="ingest") as read_only:
        qw.attach(_model(), run=run, url=collector.url, token=READ_ONLY_TOKEN, spool_dir=tmp_path, **OPTIONS)
    assert read_only.value.field == "token"

    second = qw.attach(model, run=run, url=collector.url, token=INGEST_TOKEN, spool_dir=tmp_path, **OPTIONS)
    _train(model, second, range(20, 30))
    assert second.close(30).delivered
    stored = collector.stored_steps(run, second.layers)
    assert all(steps == list(range(30)) for steps in stored.values()), stored
    assert second.stats()["replayed_batches"] == result.spool_batches
