"""A restarted collector rebuilds its exposition from the database: latest values, streaks and firing alert states.

Real collectors (uvicorn on loopback) on a real SQLite file and on PostgreSQL: the first ingests and is stopped, a
second starts on the same database, and its ``/metrics`` must show what the first served for the same runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from quantwatch.service.exposition import (
    LatestValueCache,
    RestoreLimits,
    StartupRestore,
    StepValues,
    render_exposition,
)
from quantwatch.service.exposition.cache import StoredRank
from quantwatch.service.exposition.collector import QuantWatchCollector
from quantwatch.service.server import BackgroundServer

LAYERS = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.1.attn.qkv"]
# The families a restart must not lose, and those it rebuilds exactly (the ingest timestamp is the database's).
RESTORED_FAMILIES = (
    "quantwatch_layer_output_rel_l2_ratio",
    "quantwatch_layer_underflow_ratio",
    "quantwatch_layer_weight_rel_l2_ratio",
    "quantwatch_run_loss",
    "quantwatch_run_last_step",
    "quantwatch_exposition_layer_series_omitted",
    "quantwatch_alert_streak_steps",
    "quantwatch_alert_state",
)


def metric_lines(url: str) -> dict[str, list[str]]:
    """Sample lines of ``/metrics`` by family (the text before ``{``), in the order served."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    out: dict[str, list[str]] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            out.setdefault(line.split("{", 1)[0].split(" ", 1)[0], []).append(line)
    return out


def post(url: str, doc: dict[str, Any], encode: Callable[..., tuple[bytes, dict[str, str]]]) -> None:
    body, headers = encode(doc, "msgpack")
    answer = httpx.post(f"{url}/api/v1/ingest", content=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text


def restarted(first: BackgroundServer, start: Callable[..., BackgroundServer], **settings: Any) -> BackgroundServer:
    """Stop ``first`` and start a new collector on the same database; return it once its restore has finished."""
    first.stop()
    second = start(**settings)
    restore = second.app.state.exposition.restore
    assert restore.wait(60), "the restore did not finish"
    assert not restore.failed
    return second


def test_a_restarted_collector_serves_the_latest_values_and_firing_alerts_of_stored_runs(
    start_collector: Callable[..., BackgroundServer],
    make_batch: Callable[..., dict[str, Any]],
    encode_batch: Callable[..., tuple[bytes, dict[str, str]]],
    database_url: str,
    tmp_path: Path,
) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(
        "default_rules: false\n"
        "rules:\n  - {name: drift, metric: output_rel_l2, op: '>', threshold: 0.05, consecutive: 2}\n"
    )
    settings = {"rules_file": str(rules), "metrics_top_k": 3}
    first = start_collector(**settings)
    # Rank 0: qkv breaches at steps 10 and 11 (firing, streak 2); fc1 breaches at step 10 and is not measured at
    # step 11 (pending; its latest value is step 10's); underflow is measured at step 10 only. Rank 1: blocks.1
    # breaches once (pending).
    # Older history first: underflow of blocks.1 last measured at step 2, weight_rel_l2 at steps 2-9. The restore
    # finds blocks.1's underflow below the newest rows of the rank, all metrics together.
    weight = np.tile(np.array([0.3, 0.1, 0.2], np.float32), (8, 1)) * np.arange(1, 9, dtype=np.float32)[:, None]
    old_underflow = np.array([[np.nan, np.nan, 0.004]], np.float32)
    doc = make_batch("gpt-fp4", LAYERS, [2], {"underflow_ratio": old_underflow, "weight_rel_l2": weight[:1]})
    post(first.url, doc, encode_batch)
    post(first.url, make_batch("gpt-fp4", LAYERS, list(range(3, 10)), {"weight_rel_l2": weight[1:]}), encode_batch)
    rel = np.array([[0.06, 0.2, 0.01], [0.07, np.nan, 0.02]], np.float32)
    underflow = np.array([[0.001, 0.002, np.nan]], np.float32)
    post(first.url, make_batch("gpt-fp4", LAYERS, [10], {"underflow_ratio": underflow}), encode_batch)
    doc = make_batch("gpt-fp4", LAYERS, [10, 11], {"output_rel_l2": rel}, scalars={"loss": [2.9, 2.8]})
    post(first.url, doc, encode_batch)
    rank1 = np.array([[0.01, 0.0, 0.09]], np.float32)
    post(first.url, make_batch("gpt-fp4", LAYERS, [11], {"output_rel_l2": rank1}, rank=1), encode_batch)
    # A run whose newest batch is older than the TTL is not restored (its batch time is moved back two hours).
    post(first.url, make_batch("old-run", LAYERS, [5], {"output_rel_l2": rel[:1]}), encode_batch)
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE run_ranks SET last_seen_at = last_seen_at - 7200"
                " WHERE run_id = (SELECT id FROM runs WHERE name = 'old-run')"
            )
        )
    engine.dispose()
    before = metric_lines(first.url)
    assert [line for line in before["quantwatch_alert_state"] if 'run="gpt-fp4"' in line] == [
        'quantwatch_alert_state{layer="blocks.0.attn.qkv",rule="drift",run="gpt-fp4",state="firing"} 1.0',
        'quantwatch_alert_state{layer="blocks.0.mlp.fc1",rule="drift",run="gpt-fp4",state="pending"} 1.0',
        'quantwatch_alert_state{layer="blocks.1.attn.qkv",rule="drift",run="gpt-fp4",state="pending"} 1.0',
    ]
    assert any('run="old-run"' in line for line in before["quantwatch_alert_state"])

    second = restarted(first, start_collector, **settings)
    after = metric_lines(second.url)
    for family in RESTORED_FAMILIES:
        expected = [line for line in before[family] if 'run="old-run"' not in line]
        assert after.get(family, []) == expected, family
    assert not any('run="old-run"' in line for lines in after.values() for line in lines)
    old_value = 'quantwatch_layer_underflow_ratio{layer="blocks.1.attn.qkv",rank="0",run="gpt-fp4"} 0.004'
    assert old_value in after["quantwatch_layer_underflow_ratio"]
    # The ingest timestamp is the one the database recorded for the run's newest batch (taken before its commit).
    stored_seen = httpx.get(f"{second.url}/api/v1/runs/gpt-fp4", timeout=10).json()["last_seen_at"]
    (seen_line,) = after["quantwatch_run_last_ingest_timestamp_seconds"]
    (seen_before,) = [line for line in before["quantwatch_run_last_ingest_timestamp_seconds"] if "gpt-fp4" in line]
    assert float(seen_line.rsplit(" ", 1)[1]) == pytest.approx(stored_seen, abs=1e-3)
    assert float(seen_line.rsplit(" ", 1)[1]) <= float(seen_before.rsplit(" ", 1)[1])

    # A second replica starts on the same database while the first ingests on; it restores the same state.
    replica = start_collector(**settings)
    assert replica.app.state.exposition.restore.wait(60)
    assert metric_lines(replica.url)["quantwatch_alert_state"] == after["quantwatch_alert_state"]

    # What a collector evaluates itself supersedes what it restored: qkv breaches again, streak 3.
    post(second.url, make_batch("gpt-fp4", LAYERS, [12], {"output_rel_l2": rel[1:] * 2}), encode_batch)
    streaks = [
        'quantwatch_alert_streak_steps{layer="blocks.0.attn.qkv",rule="drift",run="gpt-fp4"} 3.0',
        'quantwatch_alert_streak_steps{layer="blocks.0.mlp.fc1",rule="drift",run="gpt-fp4"} 1.0',
        'quantwatch_alert_streak_steps{layer="blocks.1.attn.qkv",rule="drift",run="gpt-fp4"} 1.0',
    ]
    assert metric_lines(second.url)["quantwatch_alert_streak_steps"] == streaks
    # The replica follows the database on its next refresh of the restored series (called here, not waited for),
    # also when the other replica resolves the episode: qkv is calm at step 13.
    exposition = replica.app.state.exposition
    exposition.restore.refresh(exposition.cache)
    assert metric_lines(replica.url)["quantwatch_alert_streak_steps"] == streaks
    calm = np.array([[0.0, np.nan, np.nan]], np.float32)
    post(second.url, make_batch("gpt-fp4", LAYERS, [13], {"output_rel_l2": calm}), encode_batch)
    exposition.restore.refresh(exposition.cache)
    states = metric_lines(replica.url)["quantwatch_alert_state"]
    assert states == [line for line in after["quantwatch_alert_state"] if "blocks.0.attn.qkv" not in line]
    assert states == metric_lines(second.url)["quantwatch_alert_state"]


def test_a_restore_never_replaces_what_ingest_brought_first() -> None:
    cache = LatestValueCache(top_k=2, clock=lambda: 1000.0)
    cache.observe("run", 0, LAYERS[:2], [StepValues(7, {"output_rel_l2": np.array([0.5, 0.25], np.float32)})])
    stale = {"output_rel_l2": (np.array([0.9, 0.9, 0.9]), np.array([True, True, True]))}
    assert not cache.restore(StoredRank("run", 0, tuple(LAYERS), 5, 900.0, stale, {"loss": 9.0}))
    # Another rank of the same run is restored next to the live one; the run keeps its live ingest time.
    other = {"output_rel_l2": (np.array([0.125, np.nan, 0.75]), np.array([True, False, True]))}
    assert cache.restore(StoredRank("run", 1, tuple(LAYERS), 6, 900.0, other, {"loss": 2.5}))
    registry = _registry(cache)
    text_out = render_exposition(registry).decode()
    assert 'quantwatch_layer_output_rel_l2_ratio{layer="blocks.1.attn.qkv",rank="1",run="run"} 0.75' in text_out
    assert 'quantwatch_layer_output_rel_l2_ratio{layer="blocks.0.attn.qkv",rank="0",run="run"} 0.5' in text_out
    assert 'rank="1",run="run"} 0.125' not in text_out  # the top-2 cap applies to restored values as well
    assert 'quantwatch_run_loss{rank="1",run="run"} 2.5' in text_out
    assert 'quantwatch_run_loss{rank="0"' not in text_out
    assert 'quantwatch_run_last_ingest_timestamp_seconds{run="run"} 1000.0' in text_out
    assert "quantwatch_exposition_layer_values_omitted_total 0.0" in text_out  # restored values are not ingest's


def _registry(cache: LatestValueCache) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(QuantWatchCollector(cache))
    return registry


@pytest.mark.parametrize("field", ["max_runs", "max_rows", "idle_rows", "look_back_steps"])
def test_restore_limits_name_the_bad_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RestoreLimits(**{field: 0})


def test_a_failed_restore_is_logged_and_leaves_the_exposition_to_ingest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'no-tables.db'}")  # never migrated: every read fails
    restore = StartupRestore(sessionmaker(engine))
    cache = LatestValueCache()
    restore.start(cache)
    assert restore.wait(30)
    restore.stop()
    engine.dispose()
    assert restore.failed
    assert "restoring the exposition from the database failed" in caplog.text
    assert cache.run_names() == set()
    assert restore.alert_series() == ()


def test_the_refresh_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="refresh_seconds"):
        StartupRestore(sessionmaker(), refresh_seconds=0)
