"""Rollup blocks compressed (issue 21): the codec gives back every bit of every figure, a one-layer read of a block
equals that layer of the whole block, and migration 0017 rewrites stored blocks both ways with reads unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.app import create_app
from quantwatch.service.batch import decode_json
from quantwatch.service.core.db import alembic_config, upgrade
from quantwatch.service.models import MetricName, Rollup, Run
from quantwatch.service.rollup_codec import (
    GROUP_LAYERS,
    PER_LAYER_COUNTS,
    blob_layers,
    decode_blocks,
    encode_blocks,
)
from quantwatch.service.rollups import MISSING_BITS, STATS_DTYPE, Partials, dumps, group_starts
from quantwatch.service.store import Store
from tests.service.conftest import batch_doc
from tests.service.test_rollup_frontier import LAYERS, Reference, _assert_exact, _ingest

SPECIALS = np.float32([np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-45, 3.4e38, -3.4e38])


def _bits(part: Partials) -> list[list[int]]:
    """Every figure of ``part`` as the bits it is stored with (NaN payloads and the sign of zero included)."""
    wide = part.widened()
    return [
        wide.vmin.view(np.uint32).ravel().tolist(),
        wide.vmax.view(np.uint32).ravel().tolist(),
        wide.vsum.view(np.uint64).ravel().tolist(),
        wide.vcount.ravel().tolist(),
    ]


def _blocks(rows: int, cols: int, seed: int, kind: str) -> Partials:
    """Partials of blocks of 1–64 steps over ``rows`` × ``cols`` values of ``kind``."""
    rng = np.random.default_rng(seed)
    if kind == "smooth":
        values = (np.exp(rng.normal(-3, 1, cols)) * (1 + 0.01 * rng.standard_normal((rows, cols)).cumsum(0))).astype(
            np.float32
        )
    else:
        scale = 10.0 ** rng.integers(-30, 30, cols)
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        special = rng.random(values.shape) < 0.05
        values[special] = rng.choice(SPECIALS, int(special.sum()))
    if kind != "smooth":
        values.view(np.uint32)[rng.random(values.shape) < 0.1] = MISSING_BITS  # not measured
    _, starts = group_starts(np.sort(rng.integers(0, max(1, rows // 8), rows)))
    with np.errstate(invalid="ignore"):  # inf − inf in a sum: NaN, as stored
        return Partials.from_values(values).reduce(starts)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 200),
    cols=st.integers(0, 2 * GROUP_LAYERS + 3),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["smooth", "wild"]),
)
def test_the_codec_gives_back_every_bit(rows: int, cols: int, seed: int, kind: str) -> None:
    part = _blocks(rows, cols, seed, kind)
    blobs = encode_blocks(part, range(part.vmin.shape[0]))
    assert _bits(decode_blocks(blobs, cols)) == _bits(part)
    for layer in {0, cols // 2, GROUP_LAYERS, cols - 1} - {-1}:
        if layer < cols:
            assert _bits(decode_blocks(blobs, cols, layer)) == _bits(part.column(layer))
    # Read as a run grown since: the layers a block does not hold have nothing measured.
    grown = decode_blocks(blobs, cols + 5)
    assert _bits(grown.column(cols + 4)) == _bits(Partials.empty(len(blobs), 1))
    assert _bits(decode_blocks(blobs, cols + 5, cols + 2)) == _bits(Partials.empty(len(blobs), 1))
    assert all(blob_layers(b) == cols for b in blobs)


def test_a_common_count_is_stored_once() -> None:
    """Blocks whose layers all hold the same count keep it in the header; one layer short, every count is kept."""
    values = np.ones((64, 300), dtype=np.float32)
    full = Partials.from_values(values).reduce(np.zeros(1, dtype=np.int64))
    values.view(np.uint32)[5, 7] = MISSING_BITS
    short = Partials.from_values(values).reduce(np.zeros(1, dtype=np.int64))
    (a,), (b,) = encode_blocks(full, [0]), encode_blocks(short, [0])
    assert int.from_bytes(a[1:3], "little") == 64
    assert int.from_bytes(b[1:3], "little") == PER_LAYER_COUNTS
    assert decode_blocks([b], 300).vcount[0].tolist() == [64] * 7 + [63] + [64] * 292
    assert len(a) < len(b) < 18 * 300


def test_an_unknown_version_is_refused() -> None:
    blob = encode_blocks(Partials.empty(1, 3), [0])[0]
    with pytest.raises(ValueError, match="rollup codec version 7"):
        decode_blocks([bytes([7]) + blob[1:]], 3)


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    """A collector's store (folding on, as by default)."""
    app_store: Store = create_app(Settings(database_url=database_url)).state.store
    yield app_store
    app_store.engine.dispose()


def _stored(store: Store) -> dict[tuple[int, int, int, int], bytes]:
    """Every stored block's blob by (run id, metric id, level, bucket)."""
    with store.engine.connect() as conn:
        rows = conn.execute(select(Rollup.run_id, Rollup.name_id, Rollup.level, Rollup.bucket, Rollup.stats))
        return {(int(r), int(n), int(lv), int(b)): bytes(s) for r, n, lv, b, s in rows}


def test_migration_0017_rewrites_blocks_both_ways_and_reads_stay_exact(store: Store) -> None:
    """Blocks as narrow as the run was when they were written and as wide as a run of 300 layers (three groups):
    the downgrade writes each back as records of the layers it held, the same figures to the bit; the upgrade
    gives back the same blobs, and reads and ingest go on exactly."""
    ref = Reference()
    rng = np.random.default_rng(17)
    _ingest(store, "grow", list(range(600)), rng.standard_normal((600, 2)).astype(np.float32), LAYERS[:2], ref)
    _ingest(store, "grow", list(range(600, 1100)), rng.standard_normal((500, 4)).astype(np.float32), LAYERS, ref)
    wide = [f"l{i}" for i in range(300)]
    values = np.exp(rng.normal(-3, 1, 300)) * (1 + 0.01 * rng.standard_normal((1100, 300)).cumsum(0))
    store.ingest(decode_json(json.dumps(batch_doc("wide", wide, list(range(1100)), {"m": values})).encode()))
    store.compact_rollups("grow")
    store.compact_rollups("wide")
    blocks = _stored(store)
    assert {blob_layers(b) for b in blocks.values()} == {2, 4, 300}
    reads = [dumps(store.series("wide", "m", name, 0, None, None, n)) for name in ("l0", "l200") for n in (10, 20)]
    heatmap = dumps(store.heatmap("wide", "m", 0, None, None, 10, None, "max"))
    cfg = alembic_config(store.engine.url.render_as_string(hide_password=False))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0016_alert_state_binary")
    records = _stored(store)
    assert records.keys() == blocks.keys()
    for key, blob in blocks.items():
        layers = blob_layers(blob)
        assert len(records[key]) == STATS_DTYPE.itemsize * layers
        assert _bits(Partials.from_stats([records[key]], layers)) == _bits(decode_blocks([blob], layers))
    upgrade(store.engine)
    assert _stored(store) == blocks
    assert [
        dumps(store.series("wide", "m", name, 0, None, None, n)) for name in ("l0", "l200") for n in (10, 20)
    ] == reads
    assert dumps(store.heatmap("wide", "m", 0, None, None, 10, None, "max")) == heatmap
    _assert_exact(store, "grow", ref)
    _ingest(store, "grow", list(range(1100, 1300)), rng.standard_normal((200, 4)).astype(np.float32), LAYERS, ref)
    _assert_exact(store, "grow", ref)


def test_a_one_layer_read_fetches_exactly_the_layers_values(store: Store) -> None:
    """A one-layer read of stored blocks (on PostgreSQL the layer's group picked out in SQL, on SQLite the whole
    block) gives that layer of each block to the bit, over blocks of 0–200 layers (one to four groups, shared and
    per-layer counts), and nothing measured where a block holds fewer layers than the layer read."""
    store.ingest(decode_json(json.dumps(batch_doc("r", ["a"], [0], {"m": np.ones((1, 1))})).encode()))
    assert (store._layer_group_rows is not None) == (store.engine.dialect.name == "postgresql")
    widths = [0, 3, 64, 70, 130, 200, 200]
    blocks = [
        _blocks(8, w, seed, "smooth" if seed % 2 else "wild").take(np.array([0])) for seed, w in enumerate(widths)
    ]
    blobs = [encode_blocks(part, [0])[0] for part in blocks]
    assert {int.from_bytes(b[1:3], "little") == PER_LAYER_COUNTS for b in blobs[1:]} == {True, False}
    with store.engine.begin() as conn:
        run_id = conn.execute(select(Run.id).where(Run.name == "r")).scalar_one()
        nid = conn.execute(select(MetricName.id).where(MetricName.name == "m")).scalar_one()
        keys = {"run_id": run_id, "rank": 0, "name_id": nid, "level": 64}
        conn.execute(insert(Rollup), [{**keys, "bucket": 1000 + i, "stats": b} for i, b in enumerate(blobs)])
    for layer in (0, 2, 3, 63, 64, 69, 70, 129, 130, 199, 200):
        want = Partials.concat(
            [part.column(layer) if layer < w else Partials.empty(1, 1) for part, w in zip(blocks, widths, strict=True)]
        )
        with store.engine.connect() as conn:
            steps, got = store._rollup_partials(conn, run_id, 0, nid, 64, 1000, 1000 + len(blobs) - 1, layer, 201)
        assert steps.tolist() == [64 * (1000 + i) for i in range(len(blobs))]
        assert _bits(got) == _bits(want)
