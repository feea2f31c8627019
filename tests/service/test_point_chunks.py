"""Raw points folded into compressed chunks (issue 21): the codec is lossless to the bit (its version 1 still reads),
reads across chunks, folded rows and the raw tail equal the exact values (late and re-sent steps included), a crash
while folding loses and duplicates nothing, rollup blocks of few samples are not stored, and the downgrades of
migrations 0012 and 0015 give the code before them what it reads."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, text

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.app import create_app
from quantwatch.service.batch import decode_json
from quantwatch.service.core.db import alembic_config, upgrade
from quantwatch.service.exposition.queries import RankReader, RestoreLimits, recent_runs
from quantwatch.service.models import MetricName, Point, PointChunk, Rollup
from quantwatch.service.rollups import LEVELS, STATS_DTYPE
from quantwatch.service.store import Store, chunk_encoder, compaction, fold_worker, folding
from quantwatch.service.store.chunk_codec import (
    decode_steps,
    decode_times,
    decode_values,
    encode_steps,
    encode_times,
    encode_values,
)
from quantwatch.service.store.raw_points import RawPoints, Rows
from tests.service.conftest import batch_doc
from tests.service.test_rollup_frontier import (
    LAYERS,
    Reference,
    _assert_exact,
    _frontier,
    _ingest,
    batches,
    crash_crossing_batch,
    ingest_shapes,
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 140),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["bits", "walk", "special"]),
)
def test_the_codec_gives_back_every_bit(rows: int, cols: int, seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    if kind == "bits":  # every pattern: NaN payloads, the missing pattern, denormals, -0, ±inf
        words = rng.integers(0, 2**32, (rows, cols), dtype=np.uint64).astype(np.uint32)
    elif kind == "walk":
        words = (np.exp(np.cumsum(rng.normal(0, 0.01, (rows, cols)), axis=0)) * 0.03).astype(np.float32).view(np.uint32)
    else:
        special = np.array([0x7FC00001, 0x7FC00000, 0xFFC00000, 0x80000000, 0, 0x7F800000, 0xFF800000, 1], np.uint32)
        words = rng.choice(special, (rows, cols))
    blob = encode_values(words.view(np.float32))
    assert decode_values(blob).view(np.uint32).tolist() == words.tolist()
    for layer in {0, cols - 1, int(rng.integers(cols))}:
        assert decode_values(blob, layer)[:, 0].view(np.uint32).tolist() == words[:, layer].tolist()
    assert decode_values(blob, cols + 3).view(np.uint32).tolist() == [[0x7FC00001]] * rows  # a later layer: missing
    steps = np.sort(rng.choice(10**12, rows, replace=False)).astype(np.int64)
    assert decode_steps(encode_steps(steps)).tolist() == steps.tolist()
    times = [None if rng.random() < 0.3 else float(rng.random() * 2e9) for _ in range(rows)]
    assert decode_times(encode_times(times), rows) == times


VERSION_1_BLOB = bytes.fromhex(
    "01030000004600000002000000730100002f0000007801ddc1cd4b13001806f0e7ede9e0a183871d4422761091901091f010ed7d"
    "20860c110f1d7688f0e061870289288db146a8f9112812f8d10e2322222a5659ad0f6a84c88892692a1261f32bb5043b85844a7f"
    "47fd7ea104430986120c25e8c6ab27e94637bad18d6e74a31bdde84637bad18d6e74a31bdde84637bad18d6e74a3408102050a14"
    "2850a0408102050a142850a0408102050a142850a04081224488102142840811224424039de9e3d773d1bee2955ea47a7267fb83"
    "c9e73543cf7cf54df3ef772df9276d5f1e27ab333d954f07838f468e3e4c076ede3b329c2919cb1e18cdc547f2976e154abf2f94"
    "af152bb6368e6dffaa5fdea95dc2c7e2c10f2b250bfb8716f74a275603efd7cb723f0e4f6e0677372afefcaccacf574fcdd5cc7e"
    "ad9bf9565f9839313fed0f0aa7ee7f6ec84e35befdd47c67fcf4ed17d1f4ab33775fb6a4b2ad63af63b1f0b9f3e1b60b918b9723"
    "edf1a6784753b23b72ad2bd27923dc3d10c6ffc50cff96bf724d7beb78017364b6756466706466706466706466703c78a8a3a9ab"
    "ab31aaa721aeaf396ec2bca8499342198800005db10c29"
)
"""``encode_values`` of version 1 (main at cfdfdb2) of :func:`_version_1_words`: chunks folded before 0015 hold it."""


def _version_1_words() -> np.ndarray:
    words = (np.arange(3 * 70, dtype=np.float32).reshape(3, 70) * np.float32(0.25) + 1).view(np.uint32).copy()
    words[0, 5], words[1, 69], words[2, 64] = 0x7FC00001, 0x80000000, 0x7F800000
    return words


def test_chunks_of_codec_version_1_still_read_back() -> None:
    words = _version_1_words()
    assert VERSION_1_BLOB[0] == 1
    assert decode_values(VERSION_1_BLOB).view(np.uint32).tolist() == words.tolist()
    for layer in (0, 5, 63, 64, 69):
        assert decode_values(VERSION_1_BLOB, layer)[:, 0].view(np.uint32).tolist() == words[:, layer].tolist()
    assert encode_values(words.view(np.float32))[0] == 2  # what this collector writes


def _app_store(database_url: str, **settings: Any) -> Store:
    """The store of a collector built from these settings (its engine disposed by the caller)."""
    store: Store = create_app(Settings(database_url=database_url, **settings)).state.store
    return store


@pytest.fixture
def store(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A collector's store with folding on. Four rows per chunk and a compaction at every base block's edge: small
    histories make many chunks, and late steps land in them and between them."""
    monkeypatch.setattr(folding, "CHUNK_ROWS", 4)
    monkeypatch.setattr(compaction, "COMPACT_STEPS", compaction.BLOCK_STEPS)
    folded = _app_store(database_url, fold_chunks=True)
    yield folded
    folded.engine.dispose()


@pytest.fixture
def unfolded(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A collector's store with folding off (``fold_chunks`` false), over the same database."""
    monkeypatch.setattr(folding, "CHUNK_ROWS", 4)
    monkeypatch.setattr(compaction, "COMPACT_STEPS", compaction.BLOCK_STEPS)
    raw = _app_store(database_url, fold_chunks=False)
    yield raw
    raw.engine.dispose()


def _counts(store: Store, run: str) -> tuple[int, int]:
    """(chunks, raw rows) of ``run``."""
    run_id = store.run_id(run)
    with store.engine.connect() as conn:
        chunks = conn.execute(select(func.count()).where(PointChunk.run_id == run_id)).scalar_one()
        raw = conn.execute(select(func.count()).where(Point.run_id == run_id)).scalar_one()
    return int(chunks), int(raw)


def _assert_export(store: Store, run: str, *refs: Reference) -> None:
    """The CSV export holds every measured (metric, step, layer) value exactly once, with its exact value."""
    text = b"".join(store.export_csv(run)).decode()
    lines = text.splitlines()[1:]
    got = {}
    for line in lines:
        _rank, step, _, kind, name, layer, value = line.split(",")
        assert kind == "metric"
        assert (name, int(step), layer) not in got
        got[(name, int(step), layer)] = np.float32(float(value))
    want = {
        (ref.metric, s, name): np.float32(v[i])
        for ref in refs
        for s, v in ref.values.items()
        for i, name in enumerate(LAYERS)
        if not np.isnan(v[i])
    }
    assert got == want


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(shapes=batches)
def test_reads_across_chunks_and_raw_rows_are_exact(store: Store, shapes: list[Any]) -> None:
    run = f"chunks-{uuid.uuid4().hex[:8]}"
    ref, partner = ingest_shapes(store, run, shapes)
    store.compact_rollups(run)  # the frontier passes the last step: every metric's rows are folded or late-merged
    _assert_exact(store, run, ref, partner)
    _assert_export(store, run, ref, partner)
    chunks, raw = _counts(store, run)
    if len(ref.values) >= folding.CHUNK_ROWS:
        assert chunks > 0
        # What is left raw of each metric waits to fill a chunk.
        assert raw < folding.CHUNK_ROWS * len([r for r in (ref, partner) if r.values])
    _assert_read_many(store, run, ref, partner)
    heat = store.heatmap(run, "m", 0, None, None, 100_000, None, "max")
    assert heat["bucket_steps"] == 1
    for step, column in zip(heat["steps"], zip(*heat["values"], strict=True), strict=True):
        want = ref.values.get(int(step), np.full(len(LAYERS), np.nan, dtype=np.float32))
        got = np.float32([np.nan if v is None else v for v in column])
        assert np.array_equal(got, want[[LAYERS.index(n) for n in heat["layers"]]], equal_nan=True), step


def _assert_read_many(store: Store, run: str, *refs: Reference) -> None:
    """``RawPoints.read_many`` answers for several series at once what ``read`` answers for each, over ranges that
    start and end inside chunks, between them and in the raw tail (the series' chunks need not line up)."""
    refs = tuple(ref for ref in refs if ref.values)  # the partner metric may not have been sent at all
    steps = sorted({step for ref in refs for step in ref.values})
    if not steps:
        return
    run_id = store.run_id(run)
    points = RawPoints()
    with store.engine.connect() as conn:
        nids = [
            int(conn.execute(select(MetricName.id).where(MetricName.name == ref.metric)).scalar_one()) for ref in refs
        ]
        edges = [steps[0] - 1, steps[0], steps[len(steps) // 3] + 1, steps[len(steps) // 2], steps[-1], steps[-1] + 5]
        for lo, hi in [(a, b) for a in edges for b in edges if a <= b]:
            many = points.read_many(conn, run_id, 0, [*nids, 10**6], lo, hi, len(LAYERS))
            assert set(many) == {*nids, 10**6}
            assert many[10**6].values.shape == (0, len(LAYERS))  # a series with no rows: empty, of the width
            for nid in nids:
                one = points.read(conn, {"run_id": run_id, "rank": 0, "nid": nid}, lo, hi, None, len(LAYERS))
                assert many[nid].steps.tolist() == one.steps.tolist(), (nid, lo, hi)
                assert many[nid].values.view(np.uint32).tolist() == one.values.view(np.uint32).tolist()


def _late_history(store: Store, run: str, ref: Reference) -> None:
    """200 steps of a ramp in batches of 20: enough for many chunks when folding is on."""
    ramp = np.arange(200, dtype=np.float32)[:, None] * np.float32([1, -1, 0.5, 2])
    for lo in range(0, 200, 20):
        _ingest(store, run, list(range(lo, lo + 20)), ramp[lo : lo + 20], LAYERS, ref)


def test_folding_off_never_folds(unfolded: Store) -> None:
    """Folding is on by default; off, a history that folds into chunks with it on stays raw, compacted to its last
    step included, and reads back exactly."""
    assert Settings().fold_chunks
    run = "unfolded"
    ref = Reference()
    _late_history(unfolded, run, ref)
    _ingest(unfolded, run, [5, 6, 70], np.float32([[9], [8], [7]]), ["b"], ref)
    unfolded.compact_rollups(run)
    assert _frontier(unfolded, run) == 200
    assert _counts(unfolded, run) == (0, 200)
    _assert_exact(unfolded, run, ref)
    _assert_export(unfolded, run, ref)


def test_chunks_folded_earlier_read_back_with_folding_off(store: Store, unfolded: Store) -> None:
    """A database folded by a collector with folding on, then served with it off: its chunks read back exactly, a
    re-sent step over a chunk wins as a raw row, and nothing more is folded."""
    run = "was-folded"
    ref = Reference()
    _late_history(store, run, ref)
    chunks, _ = _counts(store, run)
    assert chunks > 10
    _assert_exact(unfolded, run, ref)
    _ingest(unfolded, run, [5, 6, 70], np.float32([[9], [8], [7]]), ["b"], ref)
    _ingest(unfolded, run, list(range(300, 400)), np.ones((100, 4), dtype=np.float32), LAYERS, ref)
    unfolded.compact_rollups(run)
    assert _counts(unfolded, run)[0] == chunks
    _assert_exact(unfolded, run, ref)
    _assert_export(unfolded, run, ref)
    assert [row[0] for row in unfolded.step_ranks(run, "m", 6)["values"]] == [6.0, 8.0, 3.0, 12.0]


def test_late_and_re_sent_steps_into_folded_chunks(store: Store) -> None:
    run = "late"
    ref = Reference()
    _late_history(store, run, ref)
    chunks, _ = _counts(store, run)
    assert chunks > 10
    # Re-sent steps inside chunks (one layer only: the others keep their values), and late steps between chunks.
    _ingest(store, run, [5, 6, 70], np.float32([[9], [8], [7]]), ["b"], ref)
    _assert_exact(store, run, ref)
    _ingest(store, run, list(range(300, 400)), np.ones((100, 4), dtype=np.float32), LAYERS, ref)  # compacts: refolds
    _assert_exact(store, run, ref)
    with store.engine.connect() as conn:
        behind = conn.execute(select(func.count()).select_from(Point).where(Point.step < 200)).scalar_one()
    assert behind == 0  # the re-sent rows went into their chunks
    _assert_export(store, run, ref)
    ranks = store.step_ranks(run, "m", 6)
    assert ranks["step"] == 6
    assert [row[0] for row in ranks["values"]] == [6.0, 8.0, 3.0, 12.0]


FOLD_CRASH = textwrap.dedent(
    """
    import json, os, signal, sys
    from quantwatch.service import Settings
    from quantwatch.service.batch import decode_json
    from quantwatch.service.core.db import make_engine, make_sessionmaker
    from quantwatch.service.store import Store, chunk_encoder, compaction, fold_worker, folding

    apply = folding.ChunkFolder.apply

    def killed(self, conn, fold):  # the first series' chunks are inserted and its raw rows deleted: die before commit
        apply(self, conn, fold)
        os.kill(os.getpid(), signal.SIGKILL)

    folding.CHUNK_ROWS = 4
    compaction.COMPACT_STEPS = compaction.BLOCK_STEPS
    folding.ChunkFolder.apply = killed
    settings = Settings(database_url=sys.argv[1], auto_upgrade=False, fold_chunks=True)
    engine = make_engine(settings)
    store = Store(engine, make_sessionmaker(engine), fold_chunks=settings.fold_chunks)
    store.ingest(decode_json(sys.argv[2].encode()))
    store.wait_for_folds(60)  # the background folder dies in its apply
    """
)


def test_a_crash_while_folding_loses_and_duplicates_nothing(store: Store, database_url: str) -> None:
    run = "fold-crash"
    ref, doc = crash_crossing_batch(store, database_url, run, FOLD_CRASH)
    assert _counts(store, run) == (0, 128)  # the batch and its compaction committed; the fold rolled back
    assert _frontier(store, run) == 64
    _assert_exact(store, run, ref)
    assert store.ingest(decode_json(json.dumps(doc).encode())).duplicate
    _ingest(store, run, [130], np.full((1, 4), 5.0, dtype=np.float32), LAYERS, ref)  # compacts: folds all behind
    chunks, raw = _counts(store, run)
    assert chunks == 128 // 4
    assert raw == 1
    _assert_exact(store, run, ref)
    assert store.get_run(run)["points"] == 129 * 4


def test_a_fold_whose_rows_change_after_its_plan_leaves_them_for_the_next(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step re-sent between a fold's plan (read without a lock) and its apply: the apply finds the raw rows changed
    and writes nothing for that series, so the re-sent value is kept; the next fold takes it."""
    run = "replanned"
    ref = Reference()
    _ingest(store, run, list(range(60)), np.arange(240, dtype=np.float32).reshape(60, 4), LAYERS, ref)
    plan = folding.ChunkFolder.plan

    def re_sent_meanwhile(self: folding.ChunkFolder, *args: Any) -> list[folding.SeriesFold]:
        planned = plan(self, *args)
        monkeypatch.setattr(folding.ChunkFolder, "plan", plan)
        doc = batch_doc(run, ["b"], [10], {"m": np.float32([[-1.0]])})
        store.ingest(decode_json(json.dumps(doc).encode()))  # behind the frontier: a raw row the plan read changes
        return planned

    monkeypatch.setattr(folding.ChunkFolder, "plan", re_sent_meanwhile)
    _ingest(store, run, [64], np.ones((1, 4), dtype=np.float32), LAYERS, ref)  # compacts: the fold is planned
    ref.values[10] = np.float32([40, -1, 42, 43])
    assert _counts(store, run) == (0, 61)  # the apply found step 10 changed and folded nothing
    _assert_exact(store, run, ref)
    store.compact_rollups(run)
    assert _counts(store, run) == (61 // 4, 0)
    _assert_exact(store, run, ref)
    _assert_export(store, run, ref)


def test_the_encoding_process_answers_as_the_encoder_and_ends_with_its_pipe() -> None:
    rng = np.random.default_rng(5)
    parts = [
        Rows(np.arange(s, s + 8, dtype=np.int64), rng.standard_normal((8, w)).astype(np.float32), np.full(8, 1.5e9))
        for s, w in ((0, 3), (8, 130))
    ]
    process = chunk_encoder.EncoderProcess()
    assert process.encode(parts) == folding.encode_chunks(parts)
    assert process.encode(parts[1:]) == folding.encode_chunks(parts[1:])
    process.close()
    assert process._proc.returncode == 0


def test_big_folds_are_encoded_in_the_process(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """From PROCESS_VALUES values a fold's chunks are encoded in the encoding process; they read back exactly."""
    monkeypatch.setattr(fold_worker, "PROCESS_VALUES", 8)
    calls = []
    encode = chunk_encoder.EncoderProcess.encode

    def counted(self: chunk_encoder.EncoderProcess, parts: list[Rows]) -> list[dict[str, object]]:
        calls.append(len(parts))
        return encode(self, parts)

    monkeypatch.setattr(chunk_encoder.EncoderProcess, "encode", counted)
    run = "in-process"
    ref = Reference()
    _late_history(store, run, ref)
    assert calls
    assert _counts(store, run)[0] == sum(calls)
    _assert_exact(store, run, ref)


def test_folds_vacuum_the_raw_points_table_on_postgresql(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL the folder vacuums ``points`` once its folds deleted VACUUM_BYTES of rows (here: every fold),
    so their space serves the next raw rows; reads stay exact."""
    monkeypatch.setattr(fold_worker, "VACUUM_BYTES", 1)
    last_vacuum = text("SELECT last_vacuum FROM pg_stat_user_tables WHERE relname = 'points'")
    if store.pg:
        with store.engine.connect() as conn:
            before = conn.execute(last_vacuum).scalar()
    run = "vacuumed"
    ref = Reference()
    _late_history(store, run, ref)
    _assert_exact(store, run, ref)
    if store.pg:
        with store.engine.connect() as conn:
            after = conn.execute(last_vacuum).scalar()
        assert after is not None
        assert before is None or after > before


def test_downgrade_of_0012_gives_the_raw_rows_back(store: Store) -> None:
    run = "mig-chunks"
    ref = Reference()
    rng = np.random.default_rng(3)
    values = rng.standard_normal((300, 4)).astype(np.float32)
    values[rng.random(values.shape) < 0.1] = np.nan
    values[7, 2] = np.inf
    for lo in range(0, 300, 50):
        _ingest(store, run, list(range(lo, lo + 50)), values[lo : lo + 50], LAYERS, ref)
    _ingest(store, run, [10], np.float32([[42.0]]), ["c"], ref)  # a re-sent step: raw, over its chunk's row
    chunks, raw = _counts(store, run)
    assert chunks > 0
    assert raw > 0
    before = b"".join(store.export_csv(run))
    engine = store.engine
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0011_alert_state_columns")
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Point)).scalar_one() == 300
    upgrade(engine)
    assert _counts(store, run) == (
        0,
        300,
    )  # upgraded: the raw rows are valid as they are, folded at the next compaction
    assert b"".join(store.export_csv(run)) == before
    _assert_exact(store, run, ref)
    _ingest(store, run, list(range(300, 400)), np.ones((100, 4), dtype=np.float32), LAYERS, ref)
    assert _counts(store, run)[1] < 4 + 64
    _assert_exact(store, run, ref)
    _assert_export(store, run, ref)


def test_the_metrics_restore_finds_latest_values_inside_chunks(store: Store) -> None:
    """Layer "a" was last measured long ago (its value now in a chunk), "b" at every step: the restore of the
    exposition's state reads back through the chunks to a's latest value."""
    run = "restore"
    ref = Reference()
    _ingest(store, run, list(range(40)), np.arange(80, dtype=np.float32).reshape(40, 2), ["a", "b"], ref)
    _ingest(store, run, list(range(40, 300)), np.arange(260, dtype=np.float32)[:, None] + 1000, ["b"], ref)
    assert _counts(store, run)[0] > 0
    with store.engine.connect() as conn:
        assert (
            conn.execute(select(func.count()).where(Point.run_id == store.run_id(run), Point.step < 40)).scalar() == 0
        )
    with store.factory() as session:
        (recent,) = recent_runs(session, 0.0, 10)
        (stored,) = RankReader(RestoreLimits(max_rows=400, idle_rows=400)).stored_ranks(session, recent)
    values, measured = stored.latest["m"]
    assert measured[:2].tolist() == [True, True]
    assert values[:2].tolist() == [78.0, 1259.0]  # a at step 39 (in a chunk), b at step 299


def test_a_fold_between_a_reads_frontier_and_its_rows_loses_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A series read takes the rank's frontier first; a compaction that folds rows before the read reaches them must
    not hide them (the read looks the chunks up whatever the frontier it took). PostgreSQL's statements each see the
    latest commit (read committed), where skipping the chunks on the stale frontier failed this; a SQLite read keeps
    its snapshot."""
    run = "race"
    ref = Reference()
    _ingest(store, run, list(range(60)), np.arange(240, dtype=np.float32).reshape(60, 4), LAYERS, ref)
    assert _counts(store, run) == (0, 60)
    bucketed = store._bucketed

    def folded_meanwhile(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(store, "_bucketed", bucketed)
        _ingest(store, run, [127], np.ones((1, 4), dtype=np.float32), LAYERS, Reference())  # folds steps 0–59
        assert _counts(store, run) == (60 // 4, 1)
        return bucketed(*args, **kwargs)

    monkeypatch.setattr(store, "_bucketed", folded_meanwhile)
    got = store.series(run, "m", "b", 0, None, None, 100_000)  # frontier and last step read before the fold
    assert np.asarray(got["steps"]).tolist() == list(range(60))
    assert np.asarray(got["min"], dtype=np.float64).tolist() == [float(4 * s + 1) for s in range(60)]


def _block_keys(store: Store) -> set[tuple[int, int]]:
    """(level, bucket) of every stored rollup block."""
    with store.engine.connect() as conn:
        return {(int(level), int(b)) for level, b in conn.execute(select(Rollup.level, Rollup.bucket))}


def test_sparse_blocks_are_not_stored_and_the_downgrade_of_0015_rebuilds_them(store: Store) -> None:
    """Every 10th step (the agent's sampling): no 64- or 128-step block holds 16 samples, so none is stored and reads
    of those widths take the steps from the chunks; then a dense stretch, whose blocks are. The downgrade of 0015
    decodes every chunk (version 2: the code before reads version 1 only) and stores every block of every level,
    as the code before expects; upgraded again, reads and ingest go on exactly."""
    run = "sparse"
    ref = Reference()
    rng = np.random.default_rng(11)
    for lo in range(0, 2000, 100):
        steps = list(range(lo, lo + 100, 10))
        _ingest(store, run, steps, rng.standard_normal((10, 4)).astype(np.float32), LAYERS, ref)
    for lo in range(2048, 2048 + 256, 64):
        _ingest(store, run, list(range(lo, lo + 64)), rng.standard_normal((64, 4)).astype(np.float32), LAYERS, ref)
    _ingest(store, run, [30], np.float32([[7.0]]), ["c"], ref)  # re-sent, into a chunk and its blocks
    blocks = _block_keys(store)
    assert not {(level, b) for level, b in blocks if level <= 128 and b * level < 2000}
    assert {(256, b) for b in range(2000 // 256)} <= blocks  # 25 or 26 samples each
    assert {(64, b) for b in range(2048 // 64, (2048 + 192) // 64)} <= blocks
    with store.engine.connect() as conn:
        versions = {bytes(v)[0] for (v,) in conn.execute(select(func.substr(PointChunk.vals, 1, 1)))}
    assert versions == {2}
    _assert_exact(store, run, ref)
    before = b"".join(store.export_csv(run))
    cfg = alembic_config(store.engine.url.render_as_string(hide_password=False))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0014_retention")
    assert _counts(store, run) == (0, len(ref.values))
    assert _block_keys(store) == {(level, s // level) for s in ref.values for level in LEVELS}
    with store.engine.connect() as conn:  # below 0017 blocks are records (this code reads them once upgraded)
        assert {len(bytes(s)) for (s,) in conn.execute(select(Rollup.stats))} == {STATS_DTYPE.itemsize * len(LAYERS)}
    upgrade(store.engine)
    assert b"".join(store.export_csv(run)) == before
    _ingest(store, run, list(range(2304, 2400, 10)), np.ones((10, 4), dtype=np.float32), LAYERS, ref)
    _assert_exact(store, run, ref)
    _assert_export(store, run, ref)


def test_a_block_split_by_compact_rollups_is_rebuilt_from_its_folded_rows(store: Store) -> None:
    """compact_rollups moves the frontier past the last step, inside a block, and folds the rows before it; when more
    steps of that block arrive, its next compaction rebuilds it from those folded rows too, and the parents above it,
    written once complete, hold every step."""
    run = "split"
    ref = Reference()
    ramp = np.arange(300, dtype=np.float32)[:, None] * np.float32([1, -1, 0.5, 2])
    _ingest(store, run, list(range(100)), ramp[:100], LAYERS, ref)
    store.compact_rollups(run)
    assert _frontier(store, run) == 100
    assert _counts(store, run) == (100 // 4, 0)
    for lo in range(100, 300, 50):
        _ingest(store, run, list(range(lo, lo + 50)), ramp[lo : lo + 50], LAYERS, ref)
    assert _frontier(store, run) == 256
    assert {(64, 1), (128, 0), (256, 0)} <= _block_keys(store)
    _assert_exact(store, run, ref)
