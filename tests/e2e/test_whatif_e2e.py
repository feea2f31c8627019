"""What-if statistics from a training loop to a real collector and back: the agent's figures, as ``/whatif``
answers them, in both encodings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

import quantwatch.agent as qw
from tests.agent.test_whatif import _model, _train


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_the_collector_answers_the_agents_whatif_figures(start_collector: Callable[..., Any], encoding: str) -> None:
    server = start_collector()
    sink = qw.InMemoryExporter()
    local = qw.attach(_model(), run="local", exporter=sink, every=1, whatif_every=2)
    _train(local._model, local, 3)
    local.close()
    sent = qw.attach(_model(), run="wire", url=server.url, every=1, whatif_every=2, encoding=encoding)
    _train(sent._model, sent, 3)
    assert sent.close(30)
    expected = {
        (record.step, layer, kind, candidate): stats
        for batch in sink.batches
        for record in batch.steps
        if record.whatif
        for kind, candidates in record.whatif.items()
        for candidate, stats in candidates.items()
        for layer in batch.layers
    }
    layers = list(sink.batches[0].layers)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/api/v1/runs/wire/whatif").json()["steps"] == [0, 2]
        compared = 0
        for step in (0, 2):
            answer = http.get("/api/v1/runs/wire/whatif", params={"step": step}).json()
            for entry in answer["entries"]:
                stats = expected[(step, entry["layer"], entry["kind"], entry["candidate"])]
                index = layers.index(entry["layer"])
                for stat in ("rel_l2", "underflow_ratio", "overflow_ratio"):
                    assert entry[stat] == pytest.approx(stats[stat][index], rel=1e-6, abs=1e-12)
                compared += 1
            own = {(e["layer"], e["kind"]): e["candidate"] for e in answer["entries"] if e["own"]}
            assert own == {
                ("0", "weight"): "fp8_e4m3:tensor",
                ("0", "input"): "fp8_e4m3:tensor",
                ("0", "grad"): "fp8_e5m2:tensor",
                ("2", "weight"): "fp4_e2m1:tensor",
                ("2", "input"): "nvfp4",
                ("2", "grad"): "fp4_e2m1:tensor",
            }
        assert compared == 2 * 30  # every figure the agent measured at both what-if steps
        advice = http.get("/api/v1/runs/wire/advice", params={"budget": "0.5"}).json()
        assert [a["layer"] for a in advice["layers"]] == layers
