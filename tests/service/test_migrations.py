"""Alembic owns the schema on both backends: upgrades from empty, and agrees with the ORM models."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.core.db import alembic_config, make_engine, upgrade
from quantwatch.service.models import Base, Rollup


def test_cli_upgrades_an_empty_database_and_models_agree(empty_database_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quantwatch.cli", "db", "upgrade", "--database-url", empty_database_url],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    engine = make_engine(Settings(database_url=empty_database_url))
    try:
        tables = set(inspect(engine).get_table_names())
        assert set(Base.metadata.tables) <= tables
        head = ScriptDirectory.from_config(alembic_config(empty_database_url)).get_current_head()
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == []
        upgrade(engine)  # a second upgrade is a no-op
    finally:
        engine.dispose()


def test_app_upgrades_an_empty_database_on_start(empty_database_url: str) -> None:
    from fastapi.testclient import TestClient

    from quantwatch.service import create_app

    app = create_app(Settings(database_url=empty_database_url))
    try:
        with TestClient(app) as client:
            assert client.get("/readyz").json() == {"status": "ready"}
            assert client.get("/api/v1/runs").json() == []
    finally:
        app.state.engine.dispose()


def test_level_128_backfill_rebuilds_what_ingest_writes(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    """Revision 0003 fills the 128-step rollups of history stored before it; they must equal ingest's own."""
    rng = np.random.default_rng(5)
    layers = ["a", "b", "c"]
    steps = np.sort(rng.choice(np.arange(3000), size=1800, replace=False))
    values = rng.standard_normal((steps.size, 4)).astype(np.float32)
    values[rng.random(values.shape) < 0.1] = np.nan  # not measured
    values[7, 1] = np.inf
    half = steps.size // 2
    # The second half adds a layer: older level-64 blobs are narrower than newer ones, also within one block.
    for part, names in ((slice(0, half), layers), (slice(half, None), [*layers, "d"])):
        doc = make_batch("mig", names, steps[part].tolist(), {"m": values[part, : len(names)]})
        assert post_batch(doc).status_code == 200
    params = {"metric": "m", "layer": "b", "max_points": 30}
    before = client.get("/api/v1/runs/mig/series", params=params).json()
    assert before["bucket_steps"] == 128
    engine = client.app.state.engine
    client.app.state.store.compact_rollups("mig")  # ingest builds a block once complete: build the last ones too
    level_128 = select(Rollup.run_id, Rollup.rank, Rollup.name_id, Rollup.bucket, Rollup.stats).where(
        Rollup.level == 128
    )

    def rows() -> list[tuple[Any, ...]]:
        with engine.connect() as conn:
            return [(*r[:4], bytes(r[4])) for r in conn.execute(level_128.order_by(Rollup.bucket))]

    written = rows()
    complete = (int(steps[-1]) + 1) // 128 * 128  # blocks above level 64 are written once complete
    assert len(written) == np.unique(steps[steps < complete] // 128).size
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002_alerts")
    assert rows() == []
    upgrade(engine)
    assert rows()[: len(written)] == written  # and the partial last block, which the downgrade of 0015 built
    assert client.get("/api/v1/runs/mig/series", params=params).json() == before
