"""Rules that select layers by number format, and baseline-relative rules against an independent model."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from quantwatch.service.alerts.columns import evaluate_columns
from quantwatch.service.alerts.evaluator import (
    BatchColumns,
    LayerFormatView,
    SeriesState,
    StepInput,
    evaluate_batch,
)
from quantwatch.service.alerts.rules import Rule

FP8 = {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
NVFP4 = {"weight": "nvfp4", "input": "nvfp4", "grad": "fp8_e5m2:tensor"}
MXFP4_HP_GRAD = {"weight": "mxfp4", "input": "mxfp4", "grad": "high_precision"}
INT8_WEIGHT = {"weight": "int8:channel"}
LAYERS = ["fp8", "nvfp4", "mxfp4", "int8", "unknown"]
FORMATS = LayerFormatView({"fp8": FP8, "nvfp4": NVFP4, "mxfp4": MXFP4_HP_GRAD, "int8": INT8_WEIGHT})


def rule(**fields: Any) -> Rule:
    return Rule.model_validate(
        {"name": "r", "metric": "output_rel_l2", "op": ">", "threshold": 0.05, "consecutive": 1, **fields}
    )


@pytest.mark.parametrize(
    ("fields", "selected"),
    [
        ({}, LAYERS),
        ({"formats": ["fp8*", "mxfp8", "int8*"]}, ["fp8", "nvfp4", "int8"]),  # nvfp4's grad is FP8
        ({"formats": ["fp8*", "int8*"], "format_kind": "weight"}, ["fp8", "int8"]),
        ({"formats": ["*fp4*"]}, ["nvfp4", "mxfp4"]),
        ({"formats": ["high_precision"], "format_kind": "grad"}, ["mxfp4"]),
        ({"formats": ["fp8*"], "format_kind": "input"}, ["fp8"]),  # int8 declares no input format
        ({"exclude_formats": ["*fp4*"]}, ["fp8", "int8", "unknown"]),  # unknown formats are not excluded
        ({"exclude_formats": ["*fp4*"], "format_kind": "grad"}, ["fp8", "nvfp4", "mxfp4", "int8", "unknown"]),
        ({"formats": ["*"], "exclude_formats": ["nvfp4"]}, ["fp8", "mxfp4", "int8"]),  # unknown matches no formats
        ({"layers": ["n*", "u*"], "exclude_formats": ["nvfp4"]}, ["unknown"]),
    ],
)
def test_format_globs_select_layers(fields: dict[str, Any], selected: list[str]) -> None:
    watched = rule(**fields)
    assert [layer for layer in LAYERS if watched.matches_layer(layer, FORMATS.current.get(layer))] == selected
    steps = [StepInput(3, 3.0, {"output_rel_l2": [0.5] * len(LAYERS)}, {})]
    for_batch = evaluate_batch([watched], "run", 0, LAYERS, steps, {}, FORMATS)
    assert sorted(layer for _, layer in for_batch[0]) == sorted(selected)
    columns = BatchColumns.from_steps(len(LAYERS), steps, ["output_rel_l2"])
    with_formats = BatchColumns(columns.steps, columns.times, columns.metrics, columns.scalars, FORMATS)
    assert evaluate_columns([watched], "run", 0, LAYERS, with_formats, {}) == for_batch


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"baseline": {"samples": 0, "factor": 2}}, ("baseline", "samples")),
        ({"baseline": {"samples": 5, "factor": 0}}, ("baseline", "factor")),
        ({"baseline": {"samples": 5, "factor": -1}}, ("baseline", "factor")),
        ({"baseline": {"samples": 5}}, ("baseline", "factor")),
        ({"baseline": {"samples": 5, "factor": 2, "extra": 1}}, ("baseline", "extra")),
        ({"formats": []}, ("formats",)),
        ({"formats": ["fp8[e4"]}, ("formats",)),
        ({"exclude_formats": ["ok", "a[b"]}, ("exclude_formats",)),
        ({"format_kind": "bias", "formats": ["*"]}, ("format_kind",)),
    ],
)
def test_bad_selection_and_baseline_fields_are_named(fields: dict[str, Any], field: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as caught:
        rule(**fields)
    assert [tuple(error["loc"]) for error in caught.value.errors()] == [field]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"metric": None, "scalar": "loss", "formats": ["fp8*"]}, "`formats` applies to metric rules only"),
        ({"metric": None, "scalar": "loss", "baseline": {"samples": 3, "factor": 2}}, "`baseline` applies"),
        ({"format_kind": "grad"}, "`format_kind` applies with `formats` or `exclude_formats`"),
        ({"op": "<", "baseline": {"samples": 3, "factor": 2}}, "worse direction of output_rel_l2: op '>'"),
        ({"metric": "update_cosine", "baseline": {"samples": 3, "factor": 2}}, "worse direction of update_cosine"),
        ({"metric": "output_sqnr_db", "op": "<", "baseline": {"samples": 3, "factor": 2}}, "neither"),
    ],
)
def test_rules_that_cannot_mean_anything_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        rule(**fields)


# -- baseline rules against an independent model --------------------------------------------------------------------
rel_values = st.one_of(st.none(), st.sampled_from([0.0, 0.02, 0.05, 0.1, 0.2, 0.4, math.nan, math.inf]))
cos_values = st.one_of(st.none(), st.sampled_from([1.0, 0.999, 0.99, 0.97, 0.9, 0.6, math.nan, -math.inf]))
baseline_rules = st.builds(
    lambda cosine, samples, factor, threshold, consecutive, keep: Rule(
        name="r",
        metric="update_cosine" if cosine else "output_rel_l2",
        op="<" if cosine else ">",
        threshold=1.0 - threshold if cosine else threshold,
        consecutive=consecutive,
        keep_firing_for=keep,
        baseline={"samples": samples, "factor": factor},
    ),
    st.booleans(),
    st.integers(1, 4),
    st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0]),
    st.sampled_from([0.0, 0.01, 0.05]),
    st.integers(1, 3),
    st.integers(0, 2),
)


def model_breaches(samples: list[tuple[int, float]], changes: list[int], rule: Rule) -> list[bool]:
    """Whether each counted sample breaches, from the definition: each format epoch (the samples after one format
    change) collects its first ``samples`` finite deviations, and a later sample of the epoch breaches when it breaches
    the fixed bound and its deviation exceeds ``factor`` × their median; non-finite samples always breach."""
    assert rule.baseline is not None
    cosine = rule.metric == "update_cosine"
    collected: dict[int | None, list[float]] = {}
    out = []
    for step, value in samples:
        epoch = max((change for change in changes if change <= step), default=None)
        mine = collected.setdefault(epoch, [])
        if not math.isfinite(value):
            out.append(True)
            continue
        deviation = 1.0 - value if cosine else value
        if len(mine) < rule.baseline.samples:
            mine.append(deviation)
            out.append(False)
            continue
        fixed = value < rule.threshold if cosine else value > rule.threshold
        out.append(fixed and deviation > rule.baseline.factor * statistics.median(mine))
    return out


def model_statuses(breach: list[bool], consecutive: int, keep: int) -> list[str]:
    """Status after each sample: firing from ``consecutive`` breaches in a row until ``keep`` + 1 calm ones."""
    out, streak, calm, firing = [], 0, 0, False
    for hit in breach:
        streak, calm = (streak + 1, 0) if hit else (0, calm + 1)
        if hit and streak >= consecutive:
            firing = True
        elif not hit and firing and calm > keep:
            firing = False
        out.append("firing" if firing else "pending" if hit else "inactive")
    return out


@settings(max_examples=300, deadline=None)
@given(
    rule=baseline_rules,
    cosine_values=st.lists(st.lists(st.tuples(st.integers(0, 40), cos_values), min_size=1, max_size=6), max_size=10),
    rel_l2_values=st.lists(st.lists(st.tuples(st.integers(0, 40), rel_values), min_size=1, max_size=6), max_size=10),
    changes=st.lists(st.integers(0, 40), max_size=3, unique=True).map(sorted),
)
def test_baseline_rule_matches_the_model(
    rule: Rule,
    cosine_values: list[list[tuple[int, float | None]]],
    rel_l2_values: list[list[tuple[int, float | None]]],
    changes: list[int],
) -> None:
    batch_list = cosine_values if rule.metric == "update_cosine" else rel_l2_values
    formats = LayerFormatView({"l0": NVFP4}, {"l0": tuple(changes)})
    state, by_columns = SeriesState(), SeriesState()
    transitions, column_transitions, counted, newest = [], [], [], -1
    for batch in batch_list:
        steps = [StepInput(step, float(step), {str(rule.metric): [value]}, {}) for step, value in batch]
        changed, moved = evaluate_batch([rule], "run", 0, ["l0"], steps, {("r", "l0"): state}, formats)
        state = changed.get(("r", "l0"), state)
        transitions.extend((t.sample.step, t.after.value) for t in moved)
        columns = BatchColumns.from_steps(1, steps, [str(rule.metric)])
        columns = BatchColumns(columns.steps, columns.times, columns.metrics, columns.scalars, formats)
        changed, moved = evaluate_columns([rule], "run", 0, ["l0"], columns, {("r", "l0"): by_columns})
        by_columns = changed.get(("r", "l0"), by_columns)
        column_transitions.extend((t.sample.step, t.after.value) for t in moved)
        for step, value in sorted(batch, key=lambda item: item[0]):
            if value is not None and step > newest:
                counted.append((step, value))
                newest = step
    expected = model_statuses(model_breaches(counted, changes, rule), rule.consecutive, rule.keep_firing_for)
    expected_transitions = [
        (step, after)
        for (step, _), before, after in zip(counted, ["inactive", *expected], expected, strict=False)
        if before != after
    ]
    assert transitions == expected_transitions
    assert column_transitions == transitions
    assert (by_columns.status, by_columns.streak, by_columns.baseline) == (state.status, state.streak, state.baseline)
    assert by_columns.baseline_since == state.baseline_since


def test_baseline_starts_again_when_the_format_changes() -> None:
    watched = rule(threshold=0.0, consecutive=2, baseline={"samples": 3, "factor": 2.0})
    before = LayerFormatView({"l0": FP8}, {"l0": (0,)})
    steps = [StepInput(s, float(s), {"output_rel_l2": [v]}, {}) for s, v in enumerate([0.01, 0.02, 0.03, 0.05, 0.06])]
    changed, moved = evaluate_batch([watched], "run", 0, ["l0"], steps, {}, before)
    assert [(t.sample.step, t.after.value) for t in moved] == [(3, "pending"), (4, "firing")]  # > 2 × 0.02
    state = changed[("r", "l0")]
    assert (state.baseline, state.baseline_since) == ((0.01, 0.02, 0.03), 0)
    # NVFP4 from step 5 on: its own normal (0.2) becomes the reference, and 0.3 is no breach against it.
    after = LayerFormatView({"l0": NVFP4}, {"l0": (0, 5)})
    later = [StepInput(s, float(s), {"output_rel_l2": [v]}, {}) for s, v in [(5, 0.2), (6, 0.2), (7, 0.25), (8, 0.3)]]
    changed, moved = evaluate_batch([watched], "run", 0, ["l0"], later, {("r", "l0"): state}, after)
    assert (changed[("r", "l0")].baseline, changed[("r", "l0")].baseline_since) == ((0.2, 0.2, 0.25), 5)
    assert [(t.sample.step, t.after.value) for t in moved] == [(5, "inactive")]


def test_format_selection_and_baseline_state_through_the_collector(make_app: Callable[..., Any]) -> None:
    """Over HTTP: a baseline rule for FP4 layers only; its state survives a new app on the same database."""
    body = {
        "name": "fp4_output",
        "metric": "output_rel_l2",
        "formats": ["*fp4*"],
        "format_kind": "weight",
        "op": ">",
        "threshold": 0.0,
        "consecutive": 2,
        "baseline": {"samples": 2, "factor": 2.0},
    }

    def post(client: TestClient, steps: range, values: list[float], formats: list[Any] | None) -> None:
        doc: dict[str, Any] = {
            "run": "fmt",
            "batch_id": f"fmt-{steps.start}",
            "layers": ["fp8", "fp4"],
            "steps": [{"step": s, "time": 1.7e9 + s, "metrics": {"output_rel_l2": values}} for s in steps],
        }
        if formats is not None:
            doc["layer_formats"] = formats
        assert client.post("/api/v1/ingest", json=doc).status_code == 200

    with TestClient(make_app()) as client:
        answer = client.post("/api/v1/rules", json=body)
        assert answer.status_code == 201, answer.text
        assert answer.json()["baseline"] == {"samples": 2, "factor": 2.0}
        bad = client.post("/api/v1/rules", json={**body, "name": "x", "baseline": {"samples": 0, "factor": 2}})
        assert bad.status_code == 422
        assert bad.json()["errors"][0]["field"] == "body.baseline.samples"
        post(client, range(1, 3), [0.01, 0.1], [FP8, NVFP4])  # the baseline of the FP4 layer: 0.1
    with TestClient(make_app()) as client:  # a restarted collector reads the baseline from the database
        post(client, range(3, 5), [0.01, 0.25], None)  # an older agent's batches: formats as recorded
        firing = client.get("/api/v1/alerts", params={"run": "fmt", "state": "firing"}).json()
        assert [(a["rule"], a["layer"], a["firing"]["step"]) for a in firing if a["rule"] == "fp4_output"] == [
            ("fp4_output", "fp4", 4)
        ]


def test_rules_check_shows_format_selection_and_baseline(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from quantwatch.cli import app

    good = tmp_path / "rules.yml"
    good.write_text(
        "default_rules: false\nrules:\n  - name: fp4_update\n    metric: update_cosine\n    op: '<'\n"
        "    threshold: 0.99\n    formats: ['nvfp4', 'mxfp4']\n    format_kind: weight\n"
        "    baseline: {samples: 5, factor: 2}\n    keep_firing_for: 9\n"
    )
    result = CliRunner().invoke(app, ["rules", "check", str(good)])
    assert result.exit_code == 0, result.output
    assert (
        "fp4_update: update_cosine < 0.99 and beyond 2 × the median of its first 5 samples (of 1 - cosine) for 3 "
        "step(s); resolves after 10 calm step(s); formats nvfp4, mxfp4 (weight); warning"
    ) in result.output
    bad = tmp_path / "bad.yml"
    bad.write_text(good.read_text().replace("samples: 5", "samples: 0"))
    result = CliRunner().invoke(app, ["rules", "check", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:9: rules[0].baseline.samples:" in result.output
