"""A real collector on a SQLite file for the trainer integrations (one backend is enough here: the store's two
backends are tested in tests/service)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer


@pytest.fixture
def sqlite_collector(sqlite_template: Path, tmp_path: Path) -> Iterator[BackgroundServer]:
    """A real uvicorn collector without tokens on a fresh SQLite file."""
    database = tmp_path / "collector.db"
    shutil.copy(sqlite_template, database)
    app = create_app(Settings(database_url=f"sqlite:///{database}"))
    server = BackgroundServer(app).start()
    yield server
    server.stop()
    app.state.engine.dispose()
