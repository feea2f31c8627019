"""Contract: every payload the agent sends validates against the collector's ingest decoder and route, in every
encoding, and means the same thing after decoding (values, nulls, non-finite signals, scalars)."""

from __future__ import annotations

import gzip
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import quantwatch.agent as qw
from quantwatch.agent.actions import Alert
from quantwatch.agent.wire import encode_batch
from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model
from quantwatch.protocol import FIRING_EPISODES_FIELD, Action
from quantwatch.service import IngestBatch
from quantwatch.service.api.routes.ingest import DECODERS

VARIANTS = [("json", False), ("json", True), ("msgpack", False), ("msgpack", True)]


def _decode(encoded: Any) -> IngestBatch:
    body = gzip.decompress(encoded.body) if encoded.gzip else encoded.body
    return DECODERS[encoded.content_type](body)


def _same(got: tuple[float | None, ...], sent: tuple[float | None, ...]) -> bool:
    """Equal element by element, None as None and NaN as NaN (a NaN weight's sums travel as signals)."""
    return len(got) == len(sent) and all(
        a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))
        for a, b in zip(got, sent, strict=True)
    )


def _agent_batches() -> list[qw.Batch]:
    """Batches from a real run: FP8/NVFP4 layers, a watched kernel, nulls (metrics a layer lacks), NaN and inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    recipe = Recipe(rules=[("0", QuantConfig()), ("2", QuantConfig(weight=QuantSpec("nvfp4"), grad=None))])
    quantize_model(model, recipe)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(
        model,
        run="contract/run:1",
        exporter=sink,
        every=1,
        rank=3,
        replica_group=[3, 4],  # weight fingerprints travel too
        shadow="model",
        shadow_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        max_batch_steps=2,
    )
    monitor.watch_kernel(lambda x: x.half().float(), name="cast.fp16")(torch.randn(10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(4, 8)
        if step == 2:
            x[0, 0] = float("nan")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, loss=loss, big=float("inf"), shadow_closure=lambda m, x=x: m(x).square().mean())
    assert monitor.close(10)
    return sink.batches


def test_every_agent_payload_decodes_to_the_same_figures() -> None:
    batches = _agent_batches()
    assert len(batches) == 2
    seen_null = seen_nan = seen_inf = False
    for batch in batches:
        for encoding, compress in VARIANTS:
            encoded = encode_batch(batch, encoding, compress)  # type: ignore[arg-type]
            decoded = _decode(encoded)
            reports = {report.step: report for report in decoded.rank_reports}
            for sent_step in batch.steps:
                sent_prints, report = sent_step.fingerprints, reports[sent_step.step]
                assert sent_prints is not None
                assert (report.group, report.hash) == ((3, 4), sent_prints.hash)
                assert _same(report.sum, sent_prints.sum)
                assert _same(report.sumsq, sent_prints.sumsq)
                assert report.hash[-1] is None  # the watched kernel has no weight
                assert report.environment == sent_step.environment
            assert (decoded.run, decoded.rank, decoded.batch_id) == (batch.run, batch.rank, batch.batch_id)
            assert decoded.layers == batch.layers
            assert decoded.points == batch.point_count()
            for sent, got in zip(batch.steps, decoded.steps, strict=True):
                assert got.step == sent.step
                assert got.time == pytest.approx(sent.time)
                assert set(got.metrics) == set(sent.metrics)
                for name, values in sent.metrics.items():
                    missing = got.missing.get(name, np.zeros(len(values), dtype=bool))
                    for value, decoded_value, is_missing in zip(values, got.metrics[name], missing, strict=True):
                        if value is None:
                            seen_null = True
                            assert is_missing
                        elif math.isnan(value):
                            seen_nan = True
                            assert math.isnan(decoded_value)
                            assert not is_missing
                        else:
                            assert decoded_value == np.float32(value)
                assert set(got.scalars) == set(sent.scalars)
                for name, value in sent.scalars.items():
                    if math.isnan(value):
                        assert math.isnan(got.scalars[name])
                    else:
                        seen_inf = seen_inf or math.isinf(value)
                        assert got.scalars[name] == value
    assert seen_null
    assert seen_nan
    assert seen_inf


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_collector_route_accepts_every_agent_payload(client: Any) -> None:
    fired = False
    for batch in _agent_batches():
        for encoding, compress in VARIANTS:
            encoded = encode_batch(batch, encoding, compress)  # type: ignore[arg-type]
            # a distinct batch id per variant, so each is stored rather than answered as a duplicate
            variant = qw.Batch(
                batch.run, batch.rank, f"{batch.batch_id}-{encoding}-{compress}", batch.layers, batch.steps
            )
            encoded = encode_batch(variant, encoding, compress)  # type: ignore[arg-type]
            response = client.post("/api/v1/ingest", content=encoded.body, headers=encoded.headers())
            assert response.status_code == 200, response.text
            answer = response.json()
            firing = answer.pop(FIRING_EPISODES_FIELD, None)
            assert answer == {"batch_id": variant.batch_id, "duplicate": False, "points": encoded.points}
            # The payloads diverge their loss: the answer names what fires, in the terms the agent parses.
            for alert in map(Alert.from_wire, firing or []):
                assert alert.episode > 0
                assert alert.rule.startswith("quantwatch_")
                assert alert.ranks == (3,)
                fired = True
    assert fired
    runs = client.get("/api/v1/runs").json()
    assert [r["name"] for r in runs] == ["contract/run:1"]
    assert runs[0]["ranks"] == [3]


def test_actions_from_the_agent_encoder_are_accepted_and_listed(client: Any) -> None:
    from quantwatch.agent.wire import StepRecord

    taken = (
        Action(4, "keep_high_precision", "fc2", "weight fp4_e2m1:tensor → fp8_e4m3:tensor", 9),
        Action(4, "stop_training", "", "training asked to stop after this step", None),
    )
    for encoding, compress in VARIANTS:
        batch = qw.Batch("acts", 0, f"a-{encoding}-{compress}", ("fc2",), (StepRecord(4, 1.0),), None, taken)
        encoded = encode_batch(batch, encoding, compress)  # type: ignore[arg-type]
        response = client.post("/api/v1/ingest", content=encoded.body, headers=encoded.headers())
        assert response.status_code == 200, response.text
    listed = client.get("/api/v1/actions", params={"run": "acts"}).json()
    # Stored once although sent in four batches: keyed by (rank, step, action, layer).
    assert [(a["step"], a["action"], a["layer"], a["detail"], a["episode"]) for a in listed] == [
        (4, "keep_high_precision", "fc2", "weight fp4_e2m1:tensor → fp8_e4m3:tensor", 9),
        (4, "stop_training", "", "training asked to stop after this step", None),
    ]


def test_layer_formats_from_the_agent_encoder_are_accepted_and_stored(client: Any) -> None:
    from quantwatch.agent.wire import StepRecord
    from quantwatch.service.alerts.formats import layer_format_history, layer_formats

    fp8 = {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
    nvfp4 = {"weight": "nvfp4", "input": "nvfp4", "grad": "high_precision"}
    layers = ("blocks.0.fc1", "blocks.0.fc2", "head")
    for step, (encoding, formats) in enumerate([("json", (fp8, nvfp4, None)), ("msgpack", (fp8, fp8, None))]):
        record = StepRecord(step=step, time=1.0 + step, metrics={"output_rel_l2": [0.01, 0.1, None]})
        batch = qw.Batch("contract/formats", 0, f"formats-{encoding}", layers, (record,), layer_formats=formats)
        encoded = encode_batch(batch, encoding)  # type: ignore[arg-type]
        response = client.post("/api/v1/ingest", content=encoded.body, headers=encoded.headers())
        assert response.status_code == 200, response.text
    sessions = client.app.state.store.factory
    assert layer_formats(sessions, "contract/formats") == {"blocks.0.fc1": fp8, "blocks.0.fc2": fp8}
    changes = [(c.layer, c.kind, c.step, c.format) for c in layer_format_history(sessions, "contract/formats")]
    assert [change for change in changes if change[2] == 1] == [
        ("blocks.0.fc2", "grad", 1, "fp8_e5m2:tensor"),
        ("blocks.0.fc2", "input", 1, "fp8_e4m3:tensor"),
        ("blocks.0.fc2", "weight", 1, "fp8_e4m3:tensor"),
    ]


def test_estimated_metrics_go_on_the_wire_and_are_validated_against_the_step(client: Any) -> None:
    from quantwatch.agent.wire import StepRecord, to_wire_dict
    from quantwatch.protocol import ESTIMATED_FIELD, ingest_json_schema

    estimated = StepRecord(
        step=1,
        time=1.0,
        metrics={"output_rel_l2": [0.1, 0.2], "sqnr_db": [30.0, 31.0]},
        estimated=frozenset({"sqnr_db"}),
    )
    exact = StepRecord(step=2, time=2.0, metrics={"output_rel_l2": [0.1, 0.2]})
    batch = qw.Batch("contract/estimated", 0, "estimated", ("a", "b"), (estimated, exact))
    steps = to_wire_dict(batch, "json")["steps"]
    assert steps[0][ESTIMATED_FIELD] == ["sqnr_db"]
    assert ESTIMATED_FIELD not in steps[1]  # all exact: the field is left out
    assert ESTIMATED_FIELD in ingest_json_schema()["properties"]["steps"]["items"]["properties"]
    for encoding, compress in VARIANTS:
        decoded = _decode(encode_batch(batch, encoding, compress))  # type: ignore[arg-type]
        assert [step.estimated for step in decoded.steps] == [frozenset({"sqnr_db"}), frozenset()]
    encoded = encode_batch(batch, "msgpack")
    response = client.post("/api/v1/ingest", content=encoded.body, headers=encoded.headers())
    assert response.status_code == 200, response.text
    # A name that is not one of the step's metrics is refused, naming the field.
    wrong = StepRecord(step=3, time=3.0, metrics={"output_rel_l2": [0.1, 0.2]}, estimated=frozenset({"sqnr_db"}))
    encoded = encode_batch(qw.Batch("contract/estimated", 0, "wrong", ("a", "b"), (wrong,)), "json")
    response = client.post("/api/v1/ingest", content=encoded.body, headers=encoded.headers())
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "steps[0].estimated[0]"
