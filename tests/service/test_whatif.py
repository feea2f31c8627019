"""What-if statistics on the collector: stored from a step's ``whatif``, answered by ``/whatif``, advised on by
``/advice`` (a recipe that runs) and kept by migration 0008 (the alerts' remediation: alerts/test_remediation.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import yaml
from sqlalchemy import inspect

from alembic import command
from quantwatch.kernels import QuantConfig, QuantSpec, Recipe
from quantwatch.service.core.db import alembic_config, upgrade

PROBLEM = "application/problem+json"
LAYERS = ["blocks.0.fc1", "blocks.1.fc2", "head"]
FORMATS = [
    {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"},
    {"weight": "fp4_e2m1:tensor", "input": "fp4_e2m1:tensor", "grad": "fp4_e2m1:tensor"},
    None,
]
# rel_l2 per (kind, candidate), per layer; None: the layer did not try it. Underflow of blocks.1.fc2's gradient
# under its own FP4 per-tensor format is 0.54, NVFP4 0.09 and FP8 0.001 (the remediation's example).
REL = {
    ("weight", "fp8_e4m3:tensor"): [0.030, 0.030, 0.030],
    ("weight", "mxfp8"): [0.020, 0.020, 0.020],
    ("weight", "nvfp4"): [0.040, 0.200, 0.090],
    ("weight", "mxfp4"): [0.045, 0.300, 0.100],
    ("weight", "fp4_e2m1:tensor"): [None, 0.400, None],
    ("input", "fp8_e4m3:tensor"): [0.030, 0.060, 0.030],
    ("input", "mxfp8"): [0.025, 0.070, 0.020],
    ("input", "nvfp4"): [0.100, 0.200, 0.100],
    ("input", "mxfp4"): [0.120, 0.300, 0.100],
    ("input", "fp4_e2m1:tensor"): [None, 0.500, None],
    ("grad", "fp8_e4m3:tensor"): [0.040, 0.050, 0.030],
    ("grad", "mxfp8"): [0.040, 0.060, 0.030],
    ("grad", "nvfp4"): [0.060, 0.150, 0.050],
    ("grad", "mxfp4"): [0.080, 0.200, 0.070],
    ("grad", "fp4_e2m1:tensor"): [None, 0.700, None],
    ("grad", "fp8_e5m2:block32+sr"): [0.030, None, None],
}
UNDERFLOW = {
    ("grad", "fp4_e2m1:tensor"): 0.54,
    ("grad", "nvfp4"): 0.09,
    ("grad", "mxfp4"): 0.2,
    ("grad", "fp8_e4m3:tensor"): 0.001,
    ("grad", "mxfp8"): 0.002,
}


def whatif_field(scale: float = 1.0, binary: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (kind, candidate), values in REL.items():
        rel = [None if v is None else v * scale for v in values]
        under = [None if v is None else UNDERFLOW.get((kind, candidate), 0.0) for v in values]
        stats: dict[str, Any] = {"rel_l2": rel, "underflow_ratio": under}
        if binary and None not in rel:
            stats["rel_l2"] = np.asarray(rel, dtype="<f4").tobytes()
        out.setdefault(kind, {})[candidate] = stats
    return out


def doc(run: str, steps: list[int], *, scale: float = 1.0, binary: bool = False, rel: float = 0.0) -> dict[str, Any]:
    return {
        "run": run,
        "batch_id": f"{run}-{steps[0]}-{time.monotonic_ns()}",
        "layers": LAYERS,
        "layer_formats": FORMATS,
        "steps": [
            {
                "step": s,
                "time": 1.7e9 + s,
                "metrics": {"grad_rel_l2": [rel, rel, rel]},
                **({"whatif": whatif_field(scale, binary)} if s % 10 == 0 else {}),
            }
            for s in steps
        ],
    }


def _problem(response: Any, status: int, text: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    assert text in response.json()["detail"]


@pytest.mark.parametrize("kind", ["json", "msgpack"])
def test_whatif_is_stored_and_answered_by_step_and_layer(
    post_batch: Callable[..., Any], client: Any, kind: str
) -> None:
    assert post_batch(doc("wi", list(range(15))), kind).status_code == 200
    assert post_batch(doc("wi", list(range(15, 25)), scale=2.0, binary=kind == "msgpack"), kind).status_code == 200
    latest = client.get("/api/v1/runs/wi/whatif", params={"layer": "blocks.1.fc2"}).json()
    assert latest["step"] == 20
    assert latest["steps"] == [0, 10, 20]
    rows = {(e["kind"], e["candidate"]): e for e in latest["entries"]}
    assert set(rows) == {key for key, values in REL.items() if values[1] is not None}
    assert rows[("grad", "nvfp4")]["rel_l2"] == pytest.approx(0.3, rel=1e-6)
    assert rows[("grad", "nvfp4")]["underflow_ratio"] == pytest.approx(0.09, rel=1e-6)
    assert rows[("grad", "nvfp4")]["overflow_ratio"] is None  # not sent
    assert rows[("grad", "nvfp4")]["bits"] == 4
    assert rows[("weight", "mxfp8")]["bits"] == 8
    assert [c for (k, c), e in rows.items() if e["own"]] == ["fp4_e2m1:tensor"] * 3
    first = client.get("/api/v1/runs/wi/whatif", params={"layer": "blocks.1.fc2", "step": 0}).json()
    assert {(e["kind"], e["candidate"]): e["rel_l2"] for e in first["entries"]}[("grad", "nvfp4")] == pytest.approx(
        0.15, rel=1e-6
    )
    every = client.get("/api/v1/runs/wi/whatif", params={"step": 10}).json()
    assert next(e["layer"] for e in every["entries"]) == "blocks.0.fc1"
    assert {e["layer"] for e in every["entries"]} == set(LAYERS)
    assert len(every["entries"]) == sum(v is not None for values in REL.values() for v in values)
    _problem(client.get("/api/v1/runs/wi/whatif", params={"layer": "nope"}), 404, "layer 'nope'")
    _problem(client.get("/api/v1/runs/wi/whatif", params={"step": 5}), 404, "step 5")
    _problem(client.get("/api/v1/runs/nope/whatif"), 404, "nope")
    assert client.get("/api/v1/runs/wi/whatif", params={"step": -1}).status_code == 422
    # A step sent again replaces its rows; the run's deletion takes them along.
    assert post_batch(doc("wi", [20], scale=3.0), kind).status_code == 200
    again = client.get("/api/v1/runs/wi/whatif", params={"layer": "head", "step": 20}).json()
    assert {(e["kind"], e["candidate"]): e["rel_l2"] for e in again["entries"]}[("grad", "nvfp4")] == pytest.approx(
        0.15, rel=1e-6
    )
    assert client.delete("/api/v1/runs/wi").status_code == 204
    assert post_batch(doc("wi", [1]), kind).status_code == 200
    assert client.get("/api/v1/runs/wi/whatif").json() == {
        "run": "wi",
        "rank": 0,
        "layer": None,
        "step": None,
        "steps": [],
        "entries": [],
    }


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"activation": {}}, "steps[0].whatif.activation"),
        ({"grad": {"fp9": {"rel_l2": [0.1, 0.1, 0.1]}}}, "steps[0].whatif.grad.fp9"),
        ({"grad": {"nvfp4": {"cosine": [0.1, 0.1, 0.1]}}}, "steps[0].whatif.grad.nvfp4.cosine"),
        ({"grad": {"nvfp4": {"rel_l2": [0.1]}}}, "steps[0].whatif.grad.nvfp4.rel_l2"),
    ],
)
def test_bad_whatif_fields_are_named(post_batch: Callable[..., Any], field: dict[str, Any], message: str) -> None:
    bad = doc("bad", [0])
    bad["steps"][0]["whatif"] = field
    response = post_batch(bad)
    assert response.status_code == 422
    assert message in json.dumps(response.json())


def test_advice_picks_the_cheapest_formats_within_the_budget(post_batch: Callable[..., Any], client: Any) -> None:
    assert post_batch(doc("adv", [0, 10, 20])).status_code == 200
    # A later, worse step counts: the worst rel_l2 of the window decides.
    assert post_batch(doc("adv", [30], scale=1.1)).status_code == 200
    answer = client.get("/api/v1/runs/adv/advice", params={"budget": "0.05"}).json()
    assert answer["steps"] == [0, 10, 20, 30]
    assert answer["budget"] == {"weight": 0.05, "input": 0.05, "grad": 0.05}
    picked = {(a["layer"], k): (c or {}).get("candidate") for a in answer["layers"] for k, c in a["kinds"].items()}
    assert picked == {
        ("blocks.0.fc1", "weight"): "nvfp4",  # 0.044 <= 0.05, and before mxfp4 (0.0495) on error at 4 bits
        ("blocks.0.fc1", "input"): "mxfp8",  # fp8_e4m3:tensor 0.033 loses to mxfp8 0.0275 at 8 bits
        ("blocks.0.fc1", "grad"): "fp8_e5m2:block32+sr",
        ("blocks.1.fc2", "weight"): "mxfp8",
        ("blocks.1.fc2", "input"): None,  # nothing within 0.05: high precision
        ("blocks.1.fc2", "grad"): None,  # fp8_e4m3:tensor 0.055 after the worse step
        ("head", "weight"): "mxfp8",
        ("head", "input"): "mxfp8",
        ("head", "grad"): "fp8_e4m3:tensor",
    }
    assert answer["high_precision"] == ["blocks.1.fc2"]
    per_kind = client.get("/api/v1/runs/adv/advice", params={"budget": "0.1,grad=0.2", "window": 1}).json()
    assert per_kind["steps"] == [30]
    assert per_kind["budget"] == {"weight": 0.1, "input": 0.1, "grad": 0.2}
    fc2 = next(a for a in per_kind["layers"] if a["layer"] == "blocks.1.fc2")
    assert {k: c and c["candidate"] for k, c in fc2["kinds"].items()} == {
        "weight": "mxfp8",
        "input": "fp8_e4m3:tensor",
        "grad": "nvfp4",  # 0.165 <= 0.2
    }

    namespace: dict[str, Any] = {}
    exec(answer["recipe"]["python"], namespace)
    recipe = namespace["recipe"]
    assert isinstance(recipe, Recipe)
    assert recipe.config_for("blocks.0.fc1") == QuantConfig(
        weight=QuantSpec("nvfp4"),
        input=QuantSpec("mxfp8"),
        grad=QuantSpec("fp8_e5m2", scaling="block:32", rounding="stochastic"),
    )
    assert recipe.config_for("blocks.1.fc2") == QuantConfig(weight=QuantSpec("mxfp8"), input=None, grad=None)
    assert recipe.config_for("head").grad == QuantSpec("fp8_e4m3", scaling="tensor")
    assert recipe.config_for("other") is None
    assert [namespace["module_filter_fn"](None, name) for name in LAYERS] == [True, False, True]
    spelled = yaml.safe_load(answer["recipe"]["yaml"])
    assert spelled["layers"]["blocks.1.fc2"] == {"weight": "mxfp8", "input": "high_precision", "grad": "high_precision"}
    assert spelled["high_precision"] == ["blocks.1.fc2"]
    assert spelled["steps"] == [0, 10, 20, 30]

    _problem(client.get("/api/v1/runs/adv/advice", params={"budget": "fast"}), 422, "budget")
    _problem(client.get("/api/v1/runs/adv/advice", params={"budget": "gradient=0.1"}), 422, "gradient")
    _problem(client.get("/api/v1/runs/adv/advice", params={"budget": "-1"}), 422, "budget")
    _problem(client.get("/api/v1/runs/nope/advice"), 404, "nope")
    assert post_batch(doc("old", [1])).status_code == 200  # an agent that sends no what-if
    empty = client.get("/api/v1/runs/old/advice").json()
    assert empty["layers"] == []
    assert empty["steps"] == []
    exec(empty["recipe"]["python"], namespace)
    assert namespace["recipe"].rules == ()


def test_migration_0008_keeps_the_data_and_the_whatif_table(post_batch: Callable[..., Any], client: Any) -> None:
    assert post_batch(doc("mig", list(range(21)))).status_code == 200
    before = client.get("/api/v1/runs/mig/series", params={"metric": "grad_rel_l2", "layer": "head"}).json()
    engine = client.app.state.engine
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0007_rollup_frontier")
    assert "whatif_points" not in inspect(engine).get_table_names()
    upgrade(engine)
    assert "whatif_points" in inspect(engine).get_table_names()
    assert client.get("/api/v1/runs/mig/series", params={"metric": "grad_rel_l2", "layer": "head"}).json() == before
    assert client.get("/api/v1/runs/mig/whatif").json()["steps"] == []  # the table starts empty again
    assert post_batch(doc("mig", [30])).status_code == 200
    assert client.get("/api/v1/runs/mig/whatif").json()["steps"] == [30]
