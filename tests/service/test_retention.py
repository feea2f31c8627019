"""Retention (issue 21): raw points dropped behind the compaction frontier while their rollups stay, off by default.

Reads at a resolution the rollups have answer as before the drop; raw-resolution reads over the dropped range answer
at the base rollup level, marked with ``raw_from_step``; nothing past the frontier is dropped; ingest keeps no values
behind the cut; two sweepers on one database drop each point once; the CLI pass, the collector's sweep over real
HTTP and migration 0014 up and down with data, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from sqlalchemy import func, select
from typer.testing import CliRunner

from alembic import command
from quantwatch.cli import app
from quantwatch.service import Settings
from quantwatch.service.batch import decode_json
from quantwatch.service.core.db import alembic_config, make_engine, make_sessionmaker, upgrade
from quantwatch.service.models import Point, PointChunk, Rollup, RunRank
from quantwatch.service.store import RetentionPass, RetentionPolicy, Store, compaction, folding
from quantwatch.service.store.chunk_codec import decode_steps
from quantwatch.service.store.reads import HistoryReader
from quantwatch.service.sweeper import RetentionSweeper
from tests.service.conftest import batch_doc, encode

LAYERS = ["a", "b", "c", "d"]
STEPS = 1300  # steps 0 … 1299: the frontier reaches 1280
TIME0 = 1_700_000_000.0  # batch_doc's time of step 0 (step s at TIME0 + s)


def _history(seed: int = 5) -> np.ndarray:
    """A random walk per layer, a tenth not measured, one inf: what the tests ingest."""
    rng = np.random.default_rng(seed)
    values = np.cumsum(rng.normal(0, 0.01, (STEPS, len(LAYERS))), axis=0).astype(np.float32) + np.float32(0.05)
    values[rng.random(values.shape) < 0.1] = np.nan
    values[700, 1] = np.inf
    return values


def _ingest(store: Store, run: str, steps: range | list[int], values: np.ndarray) -> None:
    doc = batch_doc(run, LAYERS, list(steps), {"m": values})
    assert not store.ingest(decode_json(json.dumps(doc).encode())).duplicate
    assert store.wait_for_folds(60)  # folded before a sweep looks (the chunks straddling the cut are the point)


def _filled(store: Store, run: str) -> np.ndarray:
    values = _history()
    for lo in range(0, STEPS, 260):
        _ingest(store, run, range(lo, lo + 260), values[lo : lo + 260])
    return values


@pytest.fixture(params=[False, True], ids=["raw", "folded"])
def store(database_url: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A store over this test's database, with folding off and on (chunks of ≥ 48 rows: the cut straddles some)."""
    monkeypatch.setattr(folding, "CHUNK_ROWS", 48)
    engine = make_engine(Settings(database_url=database_url))
    yield Store(engine, make_sessionmaker(engine), fold_chunks=request.param)
    engine.dispose()


@pytest.fixture
def raw_store(database_url: str) -> Iterator[Store]:
    """A store over this test's database with folding off (where folding changes nothing the test checks)."""
    engine = make_engine(Settings(database_url=database_url))
    yield Store(engine, make_sessionmaker(engine))
    engine.dispose()


def _raw_from(store: Store, run: str) -> int:
    with store.factory() as session:
        return int(session.scalars(select(RunRank.raw_from_step).where(RunRank.run_id == store.run_id(run))).one())


def _stored_steps(store: Store, run: str) -> list[int]:
    """Every step that has a raw row or a chunk row (with repeats: one per metric and row)."""
    run_id = store.run_id(run)
    with store.engine.connect() as conn:
        steps = [int(s) for (s,) in conn.execute(select(Point.step).where(Point.run_id == run_id))]
        for (blob,) in conn.execute(select(PointChunk.steps).where(PointChunk.run_id == run_id)):
            steps.extend(decode_steps(bytes(blob)).tolist())
    return sorted(steps)


def _rollup_rows(store: Store, run: str) -> list[tuple[Any, ...]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(Rollup.level, Rollup.bucket, Rollup.stats)
            .where(Rollup.run_id == store.run_id(run))
            .order_by(Rollup.level, Rollup.bucket)
        )
        return [(int(level), int(bucket), bytes(stats)) for level, bucket, stats in rows]


def _without_mark(answer: dict[str, Any]) -> dict[str, Any]:
    """A read's answer as plain lists, without the retention mark."""
    return {
        k: (np.asarray(v).tolist() if k != "values" else [np.asarray(r).tolist() for r in v])
        for k, v in answer.items()
        if k != "raw_from_step"
    }


# Series reads whose bucket width is a rollup level (≥ 64) and whose bounds are block boundaries or past the cut.
ROLLUP_READS = [
    (None, None, 1),  # 2048-step buckets
    (None, None, 3),  # 512
    (None, None, 12),  # 128
    (None, None, 21),  # 64
    (64, 1099, 8),  # 128, a range ending past the cut
    (128, 639, 4),  # 128, a range wholly dropped
    (0, 1299, 700),  # 2, but the range holds 1,300 samples: 64 after the drop (see the raw-resolution test)
]


def test_reads_at_rollup_resolution_answer_as_before_the_drop(store: Store) -> None:
    run = f"ret-{uuid.uuid4().hex[:8]}"
    _filled(store, run)
    reads = {
        (layer, s, e, n): store.series(run, "m", layer, 0, s, e, n) for layer in LAYERS for s, e, n in ROLLUP_READS
    }
    heat = store.heatmap(run, "m", 0, None, None, 21, None, "mean")
    rollups = _rollup_rows(store, run)
    done = store.sweep_retention(RetentionPolicy(steps=300), TIME0 + STEPS)
    assert _raw_from(store, run) == 960  # 1300 - 300 = 1000, down to a block boundary
    assert done.ranks == 1
    assert done.rows == 960  # one metric, one row per step
    assert done.points == 960 * len(LAYERS)
    assert min(_stored_steps(store, run)) == 960
    assert _rollup_rows(store, run) == rollups  # every rollup block stays as it was
    for (layer, s, e, n), before in reads.items():
        after = store.series(run, "m", layer, 0, s, e, n)
        assert after["raw_from_step"] == 960
        if before["bucket_steps"] >= 64:
            assert _without_mark(after) == _without_mark(before), (layer, s, e, n)
        else:  # raw resolution asked for: the base rollup level instead
            assert after["bucket_steps"] == 64
    heat_after = store.heatmap(run, "m", 0, None, None, 21, None, "mean")
    assert heat_after["raw_from_step"] == 960
    assert _without_mark(heat_after) == _without_mark(heat)
    # A range wholly after the cut is not marked, and is what it was.
    assert "raw_from_step" not in store.series(run, "m", "a", 0, 960, None, 100_000)


def test_a_sparse_run_cut_inside_a_block_not_yet_built_reads_as_a_run_never_cut(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every 10th step: blocks of 64 and 128 steps hold too few samples to be stored, so reads and the parent blocks
    built later take those steps from the raw points. A cut (1088) inside a 256-step block not complete yet
    (1024–1279, frontier 1216: batches compact at every base block's edge here, as the compaction sweeper does for
    a rank that stopped), then the rest of the run: every read at a rollup width, and the parents built after the cut,
    answer as those of the same run never cut, as the sweep stores the base blocks of the steps it drops."""
    monkeypatch.setattr(compaction, "COMPACT_STEPS", compaction.BLOCK_STEPS)
    cut_run, whole = f"sparse-{uuid.uuid4().hex[:8]}", f"whole-{uuid.uuid4().hex[:8]}"
    values = _history()
    first, rest = list(range(0, 1251, 10)), list(range(1260, 1300, 10))
    for lo in range(0, len(first), 13):
        _ingest(store, cut_run, first[lo : lo + 13], values[first[lo : lo + 13]])
    store.sweep_retention(RetentionPolicy(steps=100), TIME0 + STEPS)
    assert _raw_from(store, cut_run) == 1088  # 1251 - 100 = 1151, down to a block boundary
    _ingest(store, cut_run, rest, values[rest])
    every = first + rest
    for lo in range(0, len(every), 13):
        _ingest(store, whole, every[lo : lo + 13], values[every[lo : lo + 13]])
    reads = [(None, None, n) for n in (1, 2, 5, 10, 20)] + [(1024, 1279, 1), (0, 1279, 4), (64, 1151, 3)]
    for layer in LAYERS:
        for s, e, n in reads:
            answer = store.series(cut_run, "m", layer, 0, s, e, n)
            assert answer["bucket_steps"] >= 64
            assert _without_mark(answer) == _without_mark(store.series(whole, "m", layer, 0, s, e, n)), (layer, s, e)
    heat = store.heatmap(cut_run, "m", 0, None, None, 20, None, "mean")
    assert _without_mark(heat) == _without_mark(store.heatmap(whole, "m", 0, None, None, 20, None, "mean"))


def test_raw_resolution_over_the_dropped_range_answers_at_the_base_rollup_level(store: Store) -> None:
    run = f"ret-{uuid.uuid4().hex[:8]}"
    values = _filled(store, run)
    per_block = store.series(run, "m", "b", 0, None, None, 21)  # 64-step buckets, before the drop
    assert per_block["bucket_steps"] == 64
    exact_tail = store.series(run, "m", "b", 0, 960, None, 100_000)
    store.sweep_retention(RetentionPolicy(steps=300), TIME0 + STEPS)
    got = store.series(run, "m", "b", 0, None, None, 100_000)
    assert got["bucket_steps"] == 64
    assert got["raw_from_step"] == 960
    assert _without_mark(got) == _without_mark(per_block)
    # From the cut on, raw resolution is still there, exact.
    tail = store.series(run, "m", "b", 0, 960, None, 100_000)
    assert _without_mark(tail) == _without_mark(exact_tail)
    assert np.float32(tail["min"]).tolist() == [v for v in values[960:, 1].tolist() if not np.isnan(v)]
    heat = store.heatmap(run, "m", 0, 0, 200, 10_000, None, "max")
    assert heat["bucket_steps"] == 64
    assert heat["steps"].tolist() == [0, 64, 128, 192]
    # One step across ranks: the first step at or after the asked one that still has raw points.
    assert store.step_ranks(run, "m", 10)["step"] == 960
    assert store.step_ranks(run, "m", 1000)["step"] == 1000
    exported = b"".join(store.export_csv(run)).decode().splitlines()[1:]
    assert min(int(line.split(",")[1]) for line in exported) == 960


def test_a_read_that_a_sweep_overtakes_never_answers_with_holes(
    raw_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = raw_store
    run = f"ret-{uuid.uuid4().hex[:8]}"
    _filled(store, run)
    want = {n: store.series(run, "m", "a", 0, None, None, n) for n in (21, 100_000)}
    heat = store.heatmap(run, "m", 0, None, None, 21, None, "max")
    swept: list[RetentionPass] = []
    bucketed = HistoryReader._bucketed

    def sweep_first(self: HistoryReader, *args: Any) -> Any:
        # The sweep commits after the read took the rank's cut, before it reads the points (PostgreSQL reads each
        # statement at its own snapshot; a SQLite read keeps the one it started with).
        if not swept:
            swept.append(store.sweep_retention(RetentionPolicy(steps=300), TIME0 + STEPS))
        return bucketed(self, *args)

    monkeypatch.setattr(HistoryReader, "_bucketed", sweep_first)
    # The exact answer as before the sweep (a snapshot from before it), or the one after it: never one with holes.
    overtaken = _without_mark(store.series(run, "m", "a", 0, None, None, 100_000))
    assert overtaken in (_without_mark(want[100_000]), _without_mark(want[21]))
    assert swept[0].points == 960 * len(LAYERS)
    swept.clear()
    assert _without_mark(store.heatmap(run, "m", 0, None, None, 21, None, "max")) == _without_mark(heat)
    assert swept == [RetentionPass()]  # nothing left to drop: the answer is the same either way
    got = store.series(run, "m", "a", 0, None, None, 100_000)
    assert got["raw_from_step"] == 960
    assert _without_mark(got) == _without_mark(want[21])


def test_points_past_the_frontier_are_never_dropped(store: Store) -> None:
    run = f"ret-{uuid.uuid4().hex[:8]}"
    _filled(store, run)
    before = _stored_steps(store, run)
    store.sweep_retention(RetentionPolicy(steps=1), TIME0 + STEPS)
    assert _raw_from(store, run) == 1280  # the frontier: blocks from there on are not built yet
    assert _stored_steps(store, run) == [s for s in before if s >= 1280]
    again = store.sweep_retention(RetentionPolicy(steps=1), TIME0 + STEPS)
    assert again == RetentionPass()
    assert _raw_from(store, run) == 1280


def test_age_judges_each_step_by_its_time(store: Store) -> None:
    run = f"ret-{uuid.uuid4().hex[:8]}"
    _filled(store, run)
    store.sweep_retention(RetentionPolicy(age_seconds=400.0), TIME0 + STEPS)  # steps before 900 are older
    assert _raw_from(store, run) == 896
    # Either limit drops: the newest 100 steps, or younger than 400 s.
    store.sweep_retention(RetentionPolicy(steps=100, age_seconds=400.0), TIME0 + STEPS)
    assert _raw_from(store, run) == 1152


def test_a_step_sent_behind_the_cut_keeps_the_rollups_as_they_were(raw_store: Store) -> None:
    store = raw_store
    run = f"ret-{uuid.uuid4().hex[:8]}"
    values = _filled(store, run)
    store.sweep_retention(RetentionPolicy(steps=300), TIME0 + STEPS)
    before = store.series(run, "m", "c", 0, None, None, 21)
    _ingest(store, run, [10, 1290], np.float32([[9.0] * 4, [8.0] * 4]))  # behind the cut, and past the frontier
    after = store.series(run, "m", "c", 0, None, None, 21)
    assert _without_mark(after)["min"][:15] == _without_mark(before)["min"][:15]
    assert after["max"][-1] == 8.0
    assert np.isclose(float(np.nanmax(values[:64, 2])), after["max"][0])


def test_two_sweepers_on_one_database_drop_each_point_once(database_url: str) -> None:
    engines = [make_engine(Settings(database_url=database_url)) for _ in range(2)]
    stores = [Store(e, make_sessionmaker(e)) for e in engines]
    try:
        runs = [f"ret-{uuid.uuid4().hex[:8]}" for _ in range(3)]
        for run in runs:
            _filled(stores[0], run)
        results: list[RetentionPass] = []
        policy = RetentionPolicy(steps=300)
        threads = [
            threading.Thread(target=lambda s=s: results.append(s.sweep_retention(policy, TIME0 + STEPS)))
            for s in stores
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(r.points for r in results) == 3 * 960 * len(LAYERS)
        assert [_raw_from(stores[1], run) for run in runs] == [960] * 3
    finally:
        for engine in engines:
            engine.dispose()


def test_retention_is_off_by_default(make_app: Callable[..., Any]) -> None:
    settings = Settings()
    assert (settings.retention_steps, settings.retention_age) == (None, None)
    app = make_app()
    store: Store = app.state.store
    _filled(store, "kept")
    assert store.sweep_retention(RetentionPolicy(), TIME0 + 10**9) == RetentionPass()
    app.state.retention.start()
    assert app.state.retention._thread is None  # nothing to sweep: no thread
    assert _raw_from(store, "kept") == 0
    assert len(_stored_steps(store, "kept")) == STEPS
    assert b"quantwatch_retention" not in app.state.exposition.render()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"retention_steps": 0}, "retention_steps"),
        ({"retention_steps": "many"}, "retention_steps"),
        ({"retention_age": "30x"}, "retention_age"),
        ({"retention_age": "-1d"}, "retention_age"),
        ({"retention_age": 0}, "retention_age"),
        ({"retention_interval_seconds": 0}, "retention_interval_seconds"),
    ],
)
def test_bad_retention_settings_are_refused_by_name(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(**overrides)
    assert [err["loc"] for err in caught.value.errors()] == [(field,)]


def test_durations_and_policies() -> None:
    assert Settings(retention_age="30d").retention_age == 30 * 86400
    assert Settings(retention_age=" 12H ").retention_age == 12 * 3600
    assert Settings(retention_age="90").retention_age == 90
    assert Settings(retention_age="1.5w").retention_age == 1.5 * 7 * 86400
    for steps, age, field in [
        (0, None, "retention_steps"),
        (True, None, "retention_steps"),
        (None, float("inf"), "retention_age"),
    ]:
        with pytest.raises(ValueError, match=field):
            RetentionPolicy(steps, age)
    assert not RetentionPolicy().enabled
    assert RetentionPolicy(age_seconds=1).enabled
    for interval in (0, -1.0, True):
        with pytest.raises(ValueError, match="retention_interval_seconds"):
            RetentionSweeper(cast("Store", None), RetentionPolicy(steps=1), interval)


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["db", "retention", *args])


def test_the_cli_runs_a_pass(database_url: str) -> None:
    engine = make_engine(Settings(database_url=database_url))
    store = Store(engine, make_sessionmaker(engine))
    try:
        _filled(store, "by-hand")
        off = _cli("--database-url", database_url)
        assert off.exit_code == 2
        assert "retention is off" in off.output
        bad = _cli("--database-url", database_url, "--age", "soon")
        assert bad.exit_code == 2
        assert bad.output.startswith("error: retention_age:"), bad.output
        out = _cli("--database-url", database_url, "--steps", "300")
        assert out.exit_code == 0, out.output
        assert out.output.strip() == "retention dropped 3840 raw points (960 rows) in 1 transactions"
        assert _raw_from(store, "by-hand") == 960
    finally:
        engine.dispose()


def test_the_collector_sweeps_in_the_background(start_collector: Callable[..., Any]) -> None:
    server = start_collector(retention_steps=300, retention_interval_seconds=0.05)
    values = _history()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for lo in range(0, STEPS, 100):
            body, headers = encode(batch_doc("swept", LAYERS, list(range(lo, lo + 100)), {"m": values[lo : lo + 100]}))
            assert client.post("/api/v1/ingest", content=body, headers=headers).status_code == 200
        params = {"metric": "m", "layer": "a", "max_points": 100_000}
        deadline = time.monotonic() + 60
        # The sweeps ran while the batches came in (cuts behind 960 first): wait for the last one.
        while (answer := client.get("/api/v1/runs/swept/series", params=params).json()).get("raw_from_step") != 960:
            assert time.monotonic() < deadline, f"the sweep never reached step 960: {answer.get('raw_from_step')}"
            time.sleep(0.05)
        assert answer["bucket_steps"] == 64
        metrics = client.get("/metrics").text
    assert "quantwatch_retention_dropped_points_total 3840.0" in metrics.splitlines()
    shown = CliRunner().invoke(app, ["series", "swept", "--metric", "m", "--layer", "a", "--url", server.url])
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[-1].startswith("Retention dropped the raw points before step 960:")


def _downgrade_to_0013(engine: Any) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0013_alert_firing_tokens")


def test_migration_0014_goes_down_and_up_with_data(database_url: str) -> None:
    engine = make_engine(Settings(database_url=database_url))
    store = Store(engine, make_sessionmaker(engine))
    try:
        _filled(store, "migrated")
        before = store.series("migrated", "m", "a", 0, None, None, 100_000)
        _downgrade_to_0013(engine)
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(Point)).scalar_one() == STEPS
        upgrade(engine)
        assert _raw_from(store, "migrated") == 0
        assert _without_mark(store.series("migrated", "m", "a", 0, None, None, 100_000)) == _without_mark(before)
        store.sweep_retention(RetentionPolicy(steps=300), TIME0 + STEPS)
        with pytest.raises(RuntimeError, match="dropped by retention"):
            _downgrade_to_0013(engine)
        assert _raw_from(store, "migrated") == 960
    finally:
        engine.dispose()
