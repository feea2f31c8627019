"""Shared fixtures: a fresh migrated database on SQLite and PostgreSQL, and collectors (in-process and live).

``database_url`` is parametrized over both backends: any test that uses it (directly or through ``make_settings``,
``make_app``, ``client``, ``live_collector`` or ``start_collector``) runs once on SQLite and once on PostgreSQL.
PostgreSQL comes from QUANTWATCH_TEST_POSTGRES_URL; one uniquely named database is created per test session
(dropped at the end) and emptied between tests. When the server is unreachable those tests skip with the reason,
unless QUANTWATCH_REQUIRE_POSTGRES=1, which makes them fail.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from quantwatch.service import Settings, create_app
from quantwatch.service.core.db import make_engine, upgrade
from quantwatch.service.server import BackgroundServer

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def postgres_server_url() -> str:
    """The PostgreSQL URL the tests may create databases through."""
    return os.environ.get("QUANTWATCH_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


def _postgres_unreachable() -> str | None:
    try:
        engine = create_engine(postgres_server_url(), connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        return f"PostgreSQL at {make_url(postgres_server_url()).render_as_string()} unreachable: {exc}"
    return None


def create_postgres_database(prefix: str = "qw_test") -> str:
    """Create a uniquely named empty database on the test server and return its URL."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_server_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(postgres_server_url()).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(url: str) -> None:
    """Drop a database made by :func:`create_postgres_database` (closing leftover connections)."""
    name = make_url(url).database
    admin = create_engine(postgres_server_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def postgres_session_url() -> Iterator[str]:
    """One migrated PostgreSQL database for the whole session (skips or fails when unreachable, see module doc)."""
    reason = _postgres_unreachable()
    if reason is not None:
        if os.environ.get("QUANTWATCH_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"{reason} (QUANTWATCH_REQUIRE_POSTGRES=1)")
        print(f"\nskipping PostgreSQL tests: {reason}")
        pytest.skip(reason)
    url = create_postgres_database()
    engine = make_engine(Settings(database_url=url))
    upgrade(engine)
    engine.dispose()
    yield url
    drop_postgres_database(url)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty SQLite file that tests copy (migrating once per session)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    engine = make_engine(Settings(database_url=f"sqlite:///{path}"))
    upgrade(engine)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return path


def _empty_postgres(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        tables = [
            r[0]
            for r in conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'")
            )
        ]
        if tables:
            conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of an empty, migrated database: a fresh SQLite file, or the session's PostgreSQL database emptied."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "quantwatch.db"
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("postgres_session_url")
    _empty_postgres(url)
    return url


@pytest.fixture
def make_settings(database_url: str) -> Callable[..., Settings]:
    """``make_settings(**overrides)`` → Settings on this test's database."""

    def make(**overrides: Any) -> Settings:
        return Settings(**{"database_url": database_url, **overrides})

    return make


@pytest.fixture
def make_app(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Any]]:
    """``make_app(**settings_overrides)`` → a collector app on this test's database (engines disposed after)."""
    apps: list[Any] = []

    def make(**overrides: Any) -> Any:
        app = create_app(make_settings(**overrides))
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.state.engine.dispose()


@pytest.fixture
def client(make_app: Callable[..., Any]) -> Iterator[Any]:
    """An in-process httpx client (ASGI transport via TestClient) of a collector without tokens."""
    from fastapi.testclient import TestClient

    with TestClient(make_app()) as test_client:
        yield test_client


@pytest.fixture
def start_collector(make_app: Callable[..., Any]) -> Iterator[Callable[..., BackgroundServer]]:
    """``start_collector(**settings_overrides)`` → a real uvicorn collector on a free loopback port (``.url``)."""
    servers: list[BackgroundServer] = []

    def start(**overrides: Any) -> BackgroundServer:
        server = BackgroundServer(make_app(**overrides)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def live_collector(start_collector: Callable[..., BackgroundServer]) -> BackgroundServer:
    """A real uvicorn collector (no tokens) on a free loopback port; ``live_collector.url`` is its base URL."""
    return start_collector()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of a database with no tables at all (a new SQLite file, or a new PostgreSQL database dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    request.getfixturevalue("postgres_session_url")  # skips or fails the same way when unreachable
    url = create_postgres_database("qw_empty")
    yield url
    drop_postgres_database(url)
