"""Raw points' value blobs (migration 0018): on PostgreSQL compressed in the row where they compress (a metric the
same in every layer), kept as they are where they do not (noise), and read back to the bit; the downgrade restores
revision 0001's layout, and rows written in either layout read the same under both revisions. On SQLite the
revision changes nothing and reads stay exact across it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from sqlalchemy import text

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.batch import decode_json
from quantwatch.service.core.db import alembic_config, make_engine, make_sessionmaker, upgrade
from quantwatch.service.store import Store
from tests.service.conftest import batch_doc

LAYERS = [f"l{i}" for i in range(512)]
READ = (0, 137, 511)


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    """A collector's store (folding on, as by default: the few steps here fold nothing)."""
    engine = make_engine(Settings(database_url=database_url))
    yield Store(engine, make_sessionmaker(engine))
    engine.dispose()


def _values(steps: list[int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(steps[0])
    return {
        "flat": np.zeros((len(steps), len(LAYERS)), dtype=np.float32),
        "noise": rng.standard_normal((len(steps), len(LAYERS))).astype(np.float32),
    }


def _ingest(store: Store, steps: list[int], want: dict[str, dict[int, np.ndarray]]) -> None:
    values = _values(steps)
    assert not store.ingest(decode_json(json.dumps(batch_doc("raw", LAYERS, steps, values)).encode())).duplicate
    for metric, rows in values.items():
        want.setdefault(metric, {}).update(zip(steps, rows, strict=True))


def _assert_exact(store: Store, want: dict[str, dict[int, np.ndarray]]) -> None:
    for metric, rows in want.items():
        steps = sorted(rows)
        for layer in READ:
            got = store.series("raw", metric, LAYERS[layer], 0, None, None, 100_000)
            assert np.asarray(got["steps"]).tolist() == steps
            expected = [float(rows[s][layer]) for s in steps]
            assert np.float32(got["min"]).tolist() == expected
            assert np.float32(got["max"]).tolist() == expected


def _layout(store: Store) -> tuple[str, bool, list[str]]:
    """``points.vals``' storage, whether it compresses with lz4, and the table's options."""
    with store.engine.connect() as conn:
        storage, lz4 = conn.execute(
            text(
                "SELECT attstorage, attcompression = 'l' FROM pg_attribute "
                "WHERE attrelid = 'points'::regclass AND attname = 'vals'"
            )
        ).one()
        options = conn.execute(text("SELECT reloptions FROM pg_class WHERE oid = 'points'::regclass")).scalar()
    return str(storage), bool(lz4), list(options or [])


def _server_has_lz4(store: Store) -> bool:
    with store.engine.connect() as conn:
        found = conn.execute(
            text("SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'")
        ).scalar()
    return bool(found)


def _stored_bytes(store: Store, metric: str) -> dict[int, int]:
    """Bytes each raw row's blob of ``metric`` takes in the row, by step."""
    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT p.step, pg_column_size(p.vals) FROM points p JOIN metric_names m ON m.id = p.name_id "
                "WHERE m.name = :metric"
            ),
            {"metric": metric},
        ).all()
    return {int(step): int(size) for step, size in rows}


def test_migration_0018_compresses_raw_rows_that_compress_and_reads_stay_exact(store: Store) -> None:
    want: dict[str, dict[int, np.ndarray]] = {}
    _ingest(store, list(range(8)), want)
    assert store.wait_for_folds(60)
    pg = store.engine.dialect.name == "postgresql"
    blob = 4 * len(LAYERS)
    if pg:
        assert _layout(store) == ("m", _server_has_lz4(store), [])
        assert all(size < blob // 4 for size in _stored_bytes(store, "flat").values())
        assert all(size > blob for size in _stored_bytes(store, "noise").values())  # stored as it is, with its header
    _assert_exact(store, want)

    cfg = alembic_config(store.engine.url.render_as_string(hide_password=False))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0017_rollup_codec")
    _ingest(store, list(range(8, 16)), want)
    if pg:
        assert _layout(store) == ("e", False, ["toast_tuple_target=8160"])
        flat = _stored_bytes(store, "flat")
        assert all(flat[s] > blob for s in range(8, 16))  # written in 0001's layout: uncompressed
        assert all(flat[s] < blob // 4 for s in range(8))  # written before: compressed still
    _assert_exact(store, want)

    upgrade(store.engine)
    _ingest(store, list(range(16, 24)), want)
    if pg:
        assert _layout(store) == ("m", _server_has_lz4(store), [])
        flat = _stored_bytes(store, "flat")
        assert all(flat[s] < blob // 4 for s in (*range(8), *range(16, 24)))
    _assert_exact(store, want)
