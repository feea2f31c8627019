"""The collector when its database cannot take writes: ingest answers 503 naming the cause and stores nothing,
``/readyz`` answers 503 meanwhile, both recover once writes succeed again; ``serve`` that cannot open or migrate its
database exits with one line naming the cause."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg.errors
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from typer.testing import CliRunner

from quantwatch.cli import app as cli
from quantwatch.service import Settings, create_app
from quantwatch.service.api.problems import PROBLEM_TYPE_BASE
from quantwatch.service.core.db import describe_database_error

LAYERS = [f"blocks.{i}.mlp.fc1" for i in range(256)]


def _batch(batch_id: str, first_step: int, steps: int) -> dict[str, Any]:
    return {
        "run": "full-disk",
        "batch_id": batch_id,
        "layers": LAYERS,
        "steps": [
            {"step": s, "metrics": {"output_rel_l2": [0.001 * (i + s) for i in range(len(LAYERS))]}}
            for s in range(first_step, first_step + steps)
        ],
    }


def _points(client: TestClient) -> int:
    runs = {r["name"]: r for r in client.get("/api/v1/runs").json()}
    return int(runs["full-disk"]["points"]) if "full-disk" in runs else 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_full_sqlite_database_is_named_refused_with_503_and_recovers(
    make_app: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()
    engine = app.state.engine
    cap: list[int | None] = [None]

    @event.listens_for(engine, "connect")
    def _limit(dbapi_conn: Any, _record: Any) -> None:
        if cap[0] is not None:
            dbapi_conn.execute(f"PRAGMA max_page_count={cap[0]}")

    with TestClient(app) as client:
        assert client.post("/api/v1/ingest", json=_batch("first", 0, 4)).status_code == 200
        stored = _points(client)
        with engine.connect() as conn:
            cap[0] = int(conn.exec_driver_sql("PRAGMA page_count").scalar_one())  # no page more: the disk is full
        engine.dispose()
        with caplog.at_level(logging.WARNING, logger="quantwatch.service"):
            refused = [client.post("/api/v1/ingest", json=_batch("big", 4, 64)) for _ in range(2)]
            ready = client.get("/readyz")
        for answer in refused:
            assert answer.status_code == 503
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"] == PROBLEM_TYPE_BASE + "unavailable"
            assert "disk is full" in answer.json()["detail"]
            assert answer.headers["Retry-After"]
        assert ready.status_code == 503
        assert "disk is full" in ready.json()["detail"]
        assert len([r for r in caplog.records if "disk is full" in r.getMessage()]) == 1  # one line, not per try
        assert _points(client) == stored  # nothing acknowledged that was not stored

        cap[0] = None  # space returns
        engine.dispose()
        assert client.post("/api/v1/ingest", json=_batch("big", 4, 64)).json()["duplicate"] is False
        assert client.get("/readyz").status_code == 200
        assert _points(client) == stored + 64 * len(LAYERS)


@pytest.mark.postgres
@pytest.mark.parametrize("empty_database_url", ["postgres"], indirect=True)
def test_a_read_only_postgresql_database_is_named_and_readyz_says_so(empty_database_url: str) -> None:
    settings = Settings(database_url=empty_database_url)
    app = create_app(settings)
    name = make_url(empty_database_url).database
    admin = create_engine(empty_database_url, isolation_level="AUTOCOMMIT")
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
        app.state.engine.dispose()
        refused = client.post("/api/v1/ingest", json=_batch("ro", 0, 2))
        ready = client.get("/readyz")
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off'))
        app.state.engine.dispose()
        assert refused.status_code == 503
        assert "read-only" in refused.json()["detail"]
        assert ready.status_code == 503
        assert "read-only" in ready.json()["detail"]
        assert client.post("/api/v1/ingest", json=_batch("ro", 0, 2)).status_code == 200
        assert client.get("/readyz").status_code == 200
    app.state.engine.dispose()
    admin.dispose()


def test_postgresql_disk_full_and_other_causes_are_named() -> None:
    def wrapped(orig: Exception) -> DBAPIError:
        return DBAPIError.instance("INSERT", {}, orig, psycopg.errors.Error)

    disk_full = describe_database_error(wrapped(psycopg.errors.DiskFull("could not extend file")))
    assert disk_full is not None
    assert disk_full.cause == "disk-full"
    assert "disk is full" in disk_full.detail
    assert "could not extend file" in disk_full.detail
    read_only = describe_database_error(wrapped(psycopg.errors.ReadOnlySqlTransaction("read-only transaction")))
    assert read_only is not None
    assert read_only.cause == "read-only"
    locked = describe_database_error(wrapped(psycopg.errors.LockNotAvailable("could not obtain lock")))
    assert locked is not None
    assert locked.cause == "locked"
    assert describe_database_error(IntegrityError("INSERT", {}, Exception("duplicate key"))) is None


def test_serve_exits_with_one_line_when_it_cannot_open_its_database_or_rules(tmp_path: Path) -> None:
    runner = CliRunner()
    missing_rules = runner.invoke(cli, ["serve", "--port", "0", "--rules", str(tmp_path / "nope.yml")])
    assert missing_rules.exit_code == 2
    assert missing_rules.output.strip().count("\n") == 0
    assert "nope.yml" in missing_rules.output

    unopenable = f"sqlite:///file:{tmp_path}/missing/q.db?mode=ro&uri=true"
    cannot_open = runner.invoke(cli, ["serve", "--port", "0", "--database-url", unopenable])
    assert cannot_open.exit_code == 3
    assert cannot_open.output.strip().count("\n") == 0
    assert "cannot be reached or opened" in cannot_open.output

    (tmp_path / "empty.db").touch()
    read_only = f"sqlite:///file:{tmp_path}/empty.db?mode=ro&uri=true"
    cannot_migrate = runner.invoke(cli, ["serve", "--port", "0", "--database-url", read_only])
    assert cannot_migrate.exit_code == 3
    assert cannot_migrate.output.strip().count("\n") == 0
    assert "read-only" in cannot_migrate.output
