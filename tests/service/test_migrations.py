"""Alembic owns the schema on both backends: upgrades from empty, and agrees with the ORM models."""

from __future__ import annotations

import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from quantwatch.service import Settings
from quantwatch.service.core.db import alembic_config, make_engine, upgrade
from quantwatch.service.models import Base


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
