"""``layer_formats`` on the wire: decoded, refused with the field named, stored with its history, migrated."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import inspect, text

from alembic import command
from quantwatch.protocol import LAYER_FORMATS_FIELD, ingest_json_schema
from quantwatch.service.alerts.formats import FormatChange, layer_format_history, layer_formats
from quantwatch.service.batch import decode_json
from quantwatch.service.core.config import Settings
from quantwatch.service.core.db import alembic_config, make_engine, make_sessionmaker
from quantwatch.service.wire_error import WireError

FP8 = {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
FP4 = {"weight": "nvfp4", "input": "nvfp4", "grad": "fp8_e5m2:tensor"}


def doc_with(formats: Any, layers: tuple[str, ...] = ("a", "b", "c", "d"), steps: tuple[int, ...] = (1,)) -> Any:
    doc: dict[str, Any] = {
        "run": "fmt",
        "batch_id": f"b{steps[0]}-{len(json.dumps(formats))}",
        "layers": list(layers),
        "steps": [{"step": step, "metrics": {"m": [1.0] * len(layers)}} for step in steps],
    }
    if formats is not None:
        doc[LAYER_FORMATS_FIELD] = formats
    return doc


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_formats_decode_aligned_with_layers_and_batches_without_them_carry_none() -> None:
    batch = decode_json(body(doc_with([FP8, None, {"grad": "high_precision"}, {}])))
    assert batch.layer_formats == (FP8, None, {"grad": "high_precision"}, {})
    assert decode_json(body(doc_with(None))).layer_formats is None
    assert LAYER_FORMATS_FIELD in ingest_json_schema()["properties"]


@pytest.mark.parametrize(
    ("formats", "field"),
    [
        ([FP8, FP8, FP8], "layer_formats"),  # 3 entries for 4 layers
        ({"a": FP8}, "layer_formats"),
        ([FP8, "nvfp4", None, None], "layer_formats[1]"),
        ([FP8, None, {"bias": "nvfp4"}, None], "layer_formats[2].bias"),
        ([FP8, None, None, {"grad": "fp5_e2m2"}], "layer_formats[3].grad"),
        ([FP8, None, None, {"weight": "fp8_e4m3:diagonal"}], "layer_formats[3].weight"),
        ([FP8, None, None, {"input": 8}], "layer_formats[3].input"),
    ],
)
def test_bad_formats_are_refused_naming_the_field(formats: Any, field: str) -> None:
    with pytest.raises(WireError) as caught:
        decode_json(body(doc_with(formats)))
    assert caught.value.status == 422
    assert caught.value.field == field


def test_route_answers_422_naming_the_field(post_batch: Callable[..., Any], client: Any) -> None:
    answer = post_batch(doc_with([FP8, None, None, {"grad": "fp5_e2m2"}]), "msgpack")
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "layer_formats[3].grad"
    assert client.get("/api/v1/runs/fmt").status_code == 404


def test_formats_are_stored_with_the_step_of_each_change(post_batch: Callable[..., Any], client: Any) -> None:
    layers = ("a", "b")
    assert post_batch(doc_with([FP8, FP4], layers, (1, 2))).status_code == 200
    assert post_batch(doc_with([FP8, FP4], layers, (3, 4)), "msgpack").status_code == 200  # unchanged: no new row
    assert post_batch(doc_with(None, layers, (5,))).status_code == 200  # an older agent's batch changes nothing
    changed = {**FP4, "grad": "high_precision"}
    assert post_batch(doc_with([FP8, changed], layers, (7, 6))).status_code == 200
    assert post_batch(doc_with([None, changed], layers, (8,))).status_code == 200  # unknown now: history kept
    sessions = client.app.state.store.factory
    assert layer_formats(sessions, "fmt") == {"a": FP8, "b": changed}
    history = layer_format_history(sessions, "fmt")
    assert [change for change in history if change.step > 1] == [FormatChange("b", "grad", 6, "high_precision")]
    assert sorted((c.layer, c.kind, c.format) for c in history if c.step == 1) == sorted(
        [("a", kind, fmt) for kind, fmt in FP8.items()] + [("b", kind, fmt) for kind, fmt in FP4.items()]
    )
    with sessions() as session:  # a caller's session works as well as the factory
        assert layer_formats(session, "fmt")["b"]["grad"] == "high_precision"
    assert layer_formats(sessions, "no-such-run") == {}


def test_migration_0004_keeps_stored_data_and_adds_formats_and_baseline_state(empty_database_url: str) -> None:
    engine = make_engine(Settings(database_url=empty_database_url))
    try:
        cfg = alembic_config(empty_database_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0003_rollup_level_128")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, created_at, layer_count) VALUES (1, 'old', 1.0, 1)"))
            conn.execute(
                text(
                    "INSERT INTO alert_rules (id, name, source, definition, enabled, revision, updated_at) "
                    "VALUES (1, 'r', 'api', '{}', true, 1, 1.0)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO alert_series (rule_id, run, rank, layer, status, last_step, streak, clear_streak) "
                    "VALUES (1, 'old', 0, 'a', 'pending', 7, 2, 0)"
                )
            )
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0008_whatif")  # the last revision with one alert_series row per series
        assert "layer_formats" in inspect(engine).get_table_names()
        with engine.begin() as conn:
            row = conn.execute(text("SELECT status, streak, baseline, baseline_since FROM alert_series")).one()
            assert tuple(row) == ("pending", 2, None, None)
            conn.execute(
                text(
                    "INSERT INTO layer_formats (run_id, layer, kind, step, format, recorded_at) "
                    "VALUES (1, 'a', 'weight', 3, 'nvfp4', 1.0)"
                )
            )
        assert layer_formats(make_sessionmaker(engine), "old") == {"a": {"weight": "nvfp4"}}
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0003_rollup_level_128")
        assert "layer_formats" not in inspect(engine).get_table_names()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT streak FROM alert_series")).scalar_one() == 2
    finally:
        engine.dispose()


def test_layers_route_answers_formats_and_the_history_of_changed_layers(
    post_batch: Callable[..., Any], client: Any
) -> None:
    layers = ("a", "b", "c")
    assert post_batch(doc_with([FP8, FP4, None], layers, (1,))).status_code == 200
    assert post_batch(doc_with([FP8, {**FP4, "weight": "fp8_e4m3:tensor"}, None], layers, (5,))).status_code == 200
    assert post_batch(doc_with([FP8, {"grad": "high_precision"}, None], layers, (9,))).status_code == 200
    answer = client.get("/api/v1/runs/fmt/layers").json()
    assert [layer["name"] for layer in answer] == ["a", "b", "c"]
    a, b, c = answer
    assert a["formats"] == FP8
    assert a["format_changes"] == []  # never changed: no history to show
    assert b["formats"] == {"weight": "fp8_e4m3:tensor", "input": "nvfp4", "grad": "high_precision"}
    assert [(x["step"], x["kind"], x["format"]) for x in b["format_changes"]] == [
        (1, "grad", "fp8_e5m2:tensor"),
        (1, "input", "nvfp4"),
        (1, "weight", "nvfp4"),
        (5, "weight", "fp8_e4m3:tensor"),
        (9, "grad", "high_precision"),
    ]
    assert c == {"index": 2, "name": "c", "formats": None, "format_changes": []}


def test_a_layer_declaring_some_kinds_answers_null_for_the_others(post_batch: Callable[..., Any], client: Any) -> None:
    assert post_batch(doc_with([{"weight": "nvfp4"}], ("only",))).status_code == 200
    (layer,) = client.get("/api/v1/runs/fmt/layers").json()
    assert layer["formats"] == {"weight": "nvfp4", "input": None, "grad": None}
