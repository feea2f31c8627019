"""The agent against a real collector (uvicorn on loopback, SQLite file) that is stopped and restarted mid-run:
nothing recorded is lost — batches go to the disk spool during the outage and are replayed in order, by the same
process after recovery and by the next process that attaches to the same run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

import quantwatch.agent as qw
from quantwatch.agent.spool import DiskSpool
from quantwatch.kernels import QuantConfig, Recipe, quantize_model
from quantwatch.service.server import BackgroundServer

FAST_RETRY = qw.RetryPolicy(max_attempts=2, initial_seconds=0.01, max_seconds=0.2)


class CountingExporter(qw.HttpExporter):
    """The HTTP exporter, counting the points handed to it (what the agent produced)."""

    produced_points = 0
    produced_steps: list[int]

    def export(self, batch: qw.Batch) -> None:
        self.produced_points += batch.point_count()
        self.produced_steps = [*getattr(self, "produced_steps", []), *(s.step for s in batch.steps)]
        super().export(batch)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return quantize_model(model, Recipe(default=QuantConfig()))


def _train(model: nn.Module, monitor: qw.Monitor, steps: range) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in steps:
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, loss=loss)


def _summary(url: str, run: str) -> dict[str, Any]:
    runs = {r["name"]: r for r in httpx.get(f"{url}/api/v1/runs").json()}
    return runs[run]  # type: ignore[no-any-return]


def _loss_steps(url: str, run: str) -> list[int]:
    series = httpx.get(f"{url}/api/v1/runs/{run}/series", params={"scalar": "loss", "max_points": 10_000}).json()
    assert series["bucket_steps"] == 1
    return [int(step) for step in series["steps"]]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_collector_restart_mid_run_loses_nothing(make_app: Callable[..., Any], tmp_path: Path) -> None:
    server = BackgroundServer(make_app()).start()
    port = server.port
    exporter = CountingExporter(server.url, retry=FAST_RETRY, spool=DiskSpool(tmp_path / "spool", 1 << 24))
    model = _model()
    monitor = qw.attach(
        model, run="restart", exporter=exporter, every=1, flush_interval_seconds=0.05, max_batch_steps=4
    )
    _train(model, monitor, range(10))
    assert monitor.flush(30)
    server.stop()
    _train(model, monitor, range(10, 30))  # the collector is down: batches go to the spool
    assert monitor.flush(1)  # queued steps are spooled at once; the spool is retried for the rest of the second
    assert monitor.stats()["spooled_batches"] > 0
    server = BackgroundServer(make_app(), port=port).start()
    try:
        _train(model, monitor, range(30, 40))
        assert monitor.close(30)
        stats = monitor.stats()
        assert stats["spool_batches"] == 0
        assert stats["dropped_batches"] == 0
        assert stats["replayed_batches"] > 0
        assert sorted(exporter.produced_steps) == list(range(40))
        assert _summary(server.url, "restart")["points"] == exporter.produced_points
        assert _loss_steps(server.url, "restart") == list(range(40))
    finally:
        server.stop()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_next_process_replays_what_the_previous_one_spooled(make_app: Callable[..., Any], tmp_path: Path) -> None:
    server = BackgroundServer(make_app()).start()
    port, url = server.port, server.url
    server.stop()
    first = _model()
    options = {"url": url, "every": 1, "spool_dir": tmp_path, "retry": FAST_RETRY, "flush_interval_seconds": 0.05}
    monitor = qw.attach(first, run="resume", **options)
    _train(first, monitor, range(5))
    assert monitor.close(1)  # the collector is down: the spool is retried for the second, then kept
    assert monitor.stats()["spool_batches"] >= 1
    server = BackgroundServer(make_app(), port=port).start()
    try:
        second = _model()
        monitor = qw.attach(second, run="resume", **options)
        _train(second, monitor, range(5, 8))
        assert monitor.close(30)
        assert monitor.stats()["replayed_batches"] >= 1
        assert _loss_steps(url, "resume") == list(range(8))
    finally:
        server.stop()
