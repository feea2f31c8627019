"""Rollups built behind the ingest path (issue 21): reads that combine finished blocks with the raw tail are exact,
whatever the batch shapes, late steps and re-sent steps; a crash between a batch's commit and its block's compaction
loses and duplicates nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from quantwatch.service import Settings
from quantwatch.service.batch import decode_json
from quantwatch.service.core.db import make_engine, make_sessionmaker
from quantwatch.service.models import Rollup, RunRank
from quantwatch.service.store import Store, choose_width
from quantwatch.service.store.compaction import COMPACT_STEPS, DENSE_STEPS
from quantwatch.service.sweeper import CompactionSweeper
from tests.service.conftest import batch_doc

LAYERS = ["a", "b", "c", "d"]


@dataclass
class Reference:
    """What the store must answer for ``metric``: step → float32 values per layer (NaN where never measured), layers
    sent."""

    values: dict[int, np.ndarray] = field(default_factory=dict)
    layers: set[str] = field(default_factory=set)
    metric: str = "m"


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    engine = make_engine(Settings(database_url=database_url))
    yield Store(engine, make_sessionmaker(engine))
    engine.dispose()


def _ingest(
    store: Store,
    run: str,
    steps: list[int],
    values: np.ndarray,
    layers: list[str],
    ref: Reference,
    also: tuple[np.ndarray, Reference] | None = None,
) -> None:
    """Send ``values`` of ``ref.metric`` (and ``also``: a second metric's values, in the same batch) and record them."""
    sent = [(values, ref)] + ([also] if also is not None else [])
    doc = batch_doc(run, layers, steps, {r.metric: v for v, r in sent})
    assert not store.ingest(decode_json(json.dumps(doc).encode())).duplicate
    assert store.wait_for_folds(60)  # what the batch's compaction queued for the background folder is folded
    cols = [LAYERS.index(n) for n in layers]
    for metric_values, metric_ref in sent:
        metric_ref.layers.update(layers)
        for step, row in zip(steps, metric_values, strict=True):
            old = metric_ref.values.get(step, np.full(len(LAYERS), np.nan, dtype=np.float32))
            new = old.copy()
            new[cols] = np.where(np.isnan(row), old[cols], row)  # last write wins per measured (layer, step)
            metric_ref.values[step] = new


def _expected(ref: Reference, layer: int, max_points: int, lo: int, hi: int) -> dict[str, Any]:
    """The series answer computed from the reference alone (start and end open: the rank's whole range, ``lo`` to
    ``hi``, whatever metric its steps measured)."""
    steps = np.array(sorted(ref.values), dtype=np.int64)
    width = 1 if steps.size <= max_points else choose_width(lo, hi, max_points)
    buckets: dict[int, list[float]] = {}
    for s in steps.tolist():
        v = float(ref.values[s][layer])
        if not np.isnan(v):
            buckets.setdefault(s // width, []).append(v)
    keys = sorted(buckets)
    return {
        "steps": [max(k * width, lo) for k in keys],
        "min": [min(buckets[k]) for k in keys],
        "max": [max(buckets[k]) for k in keys],
        "mean": [float(np.mean(np.array(buckets[k], dtype=np.float64))) for k in keys],
        "bucket_steps": width,
    }


def _assert_exact(store: Store, run: str, *refs: Reference) -> None:
    """Every read of every layer of the metrics of ``refs`` (all that ``run`` holds) answers what they say."""
    steps = [step for ref in refs for step in ref.values]
    for ref in refs:
        _assert_metric_exact(store, run, ref, min(steps), max(steps))


def _assert_metric_exact(store: Store, run: str, ref: Reference, lo: int, hi: int) -> None:
    for layer, name in enumerate(LAYERS):
        if name not in ref.layers:
            continue
        for max_points in (1, 3, 12, 40, 100_000):  # bucket widths of 1024, 256, 64, 16 (for ~700 steps), 1
            got = store.series(run, ref.metric, name, 0, None, None, max_points)
            want = _expected(ref, layer, max_points, lo, hi)
            assert np.asarray(got["steps"]).tolist() == want["steps"], (name, max_points)
            assert got["bucket_steps"] == want["bucket_steps"]
            assert np.float32(got["min"]).tolist() == np.float32(want["min"]).tolist()
            assert np.float32(got["max"]).tolist() == np.float32(want["max"]).tolist()
            np.testing.assert_allclose(np.asarray(got["mean"], dtype=np.float64), want["mean"], rtol=1e-6)


def _frontier(store: Store, run: str) -> int:
    with store.factory() as session:
        return int(session.scalars(select(RunRank.compacted_step).where(RunRank.run_id == store.run_id(run))).one())


def ingest_shapes(store: Store, run: str, shapes: list[Any]) -> tuple[Reference, Reference]:
    """Ingest one batch per (steps, layers, seed) of ``shapes`` (random values, a fifth not measured) of metric "m",
    and in about half of them metric "n" too (so the two share some blocks, and not every step: rollups are built
    for several metrics side by side where their steps line up, one at a time where they do not), checking every
    read after each; what the store must hold of each."""
    ref, partner = Reference(), Reference(metric="n")
    for steps, layers, seed in shapes:
        rng = np.random.default_rng(seed)
        values = rng.standard_normal((2, len(steps), len(layers))).astype(np.float32)
        values[rng.random(values.shape) < 0.2] = np.nan  # not measured in this batch
        also = (values[1], partner) if rng.random() < 0.5 else None
        _ingest(store, run, sorted(steps), values[0], layers, ref, also)
        _assert_exact(store, run, ref, partner)
    return ref, partner


batches = st.lists(
    st.tuples(
        # Steps: late, re-sent, far ahead, and often a block's last step (then the newest block is complete).
        st.lists(
            st.one_of(st.integers(0, 700), st.integers(0, 10).map(lambda k: 64 * k + 63)),
            min_size=1,
            max_size=40,
            unique=True,
        ),
        st.lists(st.sampled_from(LAYERS), min_size=1, max_size=4, unique=True),
        st.integers(0, 2**32 - 1),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=batches)
def test_reads_across_the_raw_tail_and_finished_blocks_are_exact(store: Store, shapes: list[Any]) -> None:
    run = f"prop-{uuid.uuid4().hex[:8]}"
    ref, partner = ingest_shapes(store, run, shapes)
    # Built up to an edge at or before the newest step's block: its own (dense batches), or the last COMPACT_STEPS one.
    newest = max(ref.values)
    assert newest // COMPACT_STEPS * COMPACT_STEPS <= _frontier(store, run) <= newest // 64 * 64
    assert _frontier(store, run) % 64 == 0
    store.compact_rollups(run)
    assert _frontier(store, run) == max(ref.values) + 1
    _assert_exact(store, run, ref, partner)


CRASHING_INGEST = textwrap.dedent(
    """
    import json, os, signal, sys
    from quantwatch.service import Settings
    from quantwatch.service.batch import decode_json
    from quantwatch.service.core.db import make_engine, make_sessionmaker
    from quantwatch.service.store import Store
    from quantwatch.service.store.compaction import Compactor

    def killed(*args, **kwargs):  # the process dies after the batch's commit, before its compaction
        os.kill(os.getpid(), signal.SIGKILL)

    Compactor.compact = killed
    engine = make_engine(Settings(database_url=sys.argv[1], auto_upgrade=False))
    Store(engine, make_sessionmaker(engine)).ingest(decode_json(sys.argv[2].encode()))
    """
)


def crash_crossing_batch(store: Store, database_url: str, run: str, script: str) -> tuple[Reference, dict[str, Any]]:
    """Ingest steps 0–59 of ``run``, then send steps 60–127 (up to a block's last step) from a process running
    ``script``, which must kill itself after the batch's commit; what the store must hold, and the batch sent."""
    ref = Reference()
    first = np.arange(60, dtype=np.float32)[:, None] * np.ones((1, 4), dtype=np.float32)
    _ingest(store, run, list(range(60)), first, LAYERS, ref)
    assert _frontier(store, run) == 0  # block 0 is not complete yet
    # Up to a block's last step: blocks 0 and 1 (and the first 128-step block) are complete, none is built yet.
    crossing = np.full((68, 4), 100.0, dtype=np.float32)
    doc = batch_doc(run, LAYERS, list(range(60, 128)), {"m": crossing}, batch_id="crossing")
    proc = subprocess.run(
        [sys.executable, "-c", script, database_url, json.dumps(doc)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr.decode()
    for step, row in zip(range(60, 128), crossing, strict=True):
        ref.values[step] = row
    return ref, doc


def test_a_crash_between_commit_and_compaction_loses_and_duplicates_nothing(store: Store, database_url: str) -> None:
    run = "crash"
    ref, doc = crash_crossing_batch(store, database_url, run, CRASHING_INGEST)
    assert _frontier(store, run) == 0  # committed, not compacted
    _assert_exact(store, run, ref)
    assert store.ingest(decode_json(json.dumps(doc).encode())).duplicate  # the batch was durable
    assert store.get_run(run)["points"] == 128 * 4
    _ingest(store, run, [130], np.full((1, 4), 5.0, dtype=np.float32), LAYERS, ref)  # the next batch compacts
    assert _frontier(store, run) == 128
    _assert_exact(store, run, ref)
    with store.engine.connect() as conn:
        blocks = conn.execute(select(Rollup.level, Rollup.bucket).order_by(Rollup.level, Rollup.bucket)).all()
    # Complete blocks only: the 256-, 1024- and 4096-step blocks of step 0 end past the frontier.
    assert [tuple(b) for b in blocks] == [(64, 0), (64, 1), (128, 0)]
    assert store.get_run(run)["points"] == 129 * 4


@pytest.mark.parametrize("every", [2, 25])
def test_one_step_batches_compact_at_the_edges_their_sampling_calls_for(store: Store, every: int) -> None:
    """Batches of one sampled step: sampled densely (every 2nd step) each base block's edge compacts the rank; sparsely
    (every 25th, the agent's default) complete blocks wait until a batch passes the next COMPACT_STEPS edge, then are
    built in one compaction. Reads are exact all along."""
    run = f"one-step-{every}"
    ref = Reference()
    frontiers = []
    for step in range(0, 1000 if every > DENSE_STEPS else 300, every):
        _ingest(store, run, [step], np.float32([[step, -step, 0.5, 2]]), LAYERS, ref)
        frontiers.append(_frontier(store, run))
    _assert_exact(store, run, ref)
    edge = 64 if every <= DENSE_STEPS else COMPACT_STEPS
    expected, frontier = [], 0
    for step in sorted(ref.values):
        frontier = max(frontier, step // edge * edge)
        expected.append(frontier)
    assert frontiers == expected
    assert len(set(frontiers)) == (5 if every <= DENSE_STEPS else 4)  # 0 and 4 moves of the frontier, or 3


def test_a_rank_that_stops_sending_is_compacted_by_the_sweep(store: Store) -> None:
    """Complete blocks behind no edge of the rank's batches wait for its next batches; once the rank has sent nothing
    for the sweep's idle time, the compaction sweeper builds them (and a second sweep finds nothing due)."""
    run = "stopped"
    ref = Reference()
    steps = list(range(0, 255, 5))  # sampled every 5th step: sparse, so its edges are COMPACT_STEPS apart
    _ingest(store, run, steps, np.arange(4 * len(steps), dtype=np.float32).reshape(-1, 4), LAYERS, ref)
    assert _frontier(store, run) == 0  # blocks 0–2 complete, the first COMPACT_STEPS edge not passed
    sent_at = store.get_run(run)["last_seen_at"]
    assert store.compact_idle(sent_at - 1) == 0  # the rank sent a batch since
    CompactionSweeper(store, idle_seconds=30, clock=lambda: sent_at + 10).run_pass()
    assert _frontier(store, run) == 0  # not idle for long enough
    CompactionSweeper(store, idle_seconds=30, clock=lambda: sent_at + 31).run_pass()
    assert _frontier(store, run) == 192
    assert store.compact_idle(sent_at + 31) == 0  # nothing due any more
    assert store.wait_for_folds(60)
    _assert_exact(store, run, ref)
    with store.engine.connect() as conn:
        blocks = conn.execute(select(Rollup.level, Rollup.bucket).order_by(Rollup.level, Rollup.bucket)).all()
    assert [tuple(b) for b in blocks] == [(128, 0)]  # a base block's 13 samples are too few to be stored
