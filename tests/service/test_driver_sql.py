"""DriverStatement (issue 21): driver SQL compiled once writes and reads what its Core statement does, on SQLite and
PostgreSQL (values through Core's bind processors: the engine's JSON serializer, binaries, floats; a name bound
twice; RETURNING; executemany), and refuses a statement whose execution needs Core's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest
from sqlalchemy import (
    Engine,
    Table,
    Text,
    and_,
    bindparam,
    insert,
    literal_column,
    select,
    union_all,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql import ClauseElement

from quantwatch.service import Settings
from quantwatch.service.alerts.tables import FiringTokenRow, RuleRow, SeriesStatesRow
from quantwatch.service.core.db import dump_json, make_engine
from quantwatch.service.core.driver_sql import DriverStatement, conflict_statements
from quantwatch.service.models import Batch, MetricName, Point, Run

RULES = cast(Table, RuleRow.__table__)
STATES = cast(Table, SeriesStatesRow.__table__)
FIRING = cast(Table, FiringTokenRow.__table__)
STATE_FIELDS = ("rule_id", "run", "rank", "token", "series")
# Separators, a float, null and a non-ASCII key: the standard library's json.dumps would write this differently.
SERIES = {"blocks.0.é": [1, 0.1, None, [2, 3]], "b": {"x": -1.5e-8}}


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(Settings(database_url=database_url))
    yield engine
    engine.dispose()


def _add_rules(engine: Engine, enabled: list[bool]) -> None:
    rows = [
        {"name": f"r{i}", "source": "api", "definition": {}, "enabled": on, "revision": i, "updated_at": 0.0}
        for i, on in enumerate(enabled, start=1)
    ]
    with engine.begin() as conn:
        conn.execute(insert(RULES), rows)


def test_json_rows_are_written_with_the_engines_serializer_as_core_writes_them(engine: Engine) -> None:
    _add_rules(engine, [True, True, True])
    with engine.begin() as conn:
        upsert = conflict_statements(STATES, ("rule_id", "run", "rank"), ("token", "series"))[conn.dialect.name]
        conn.execute(upsert, [{"rule_id": 1, "run": "r", "rank": 0, "token": 7, "series": SERIES}])
        rows = [{"rule_id": rule_id, "run": "r", "rank": 0, "token": 7, "series": SERIES} for rule_id in (2, 3)]
        DriverStatement(upsert, STATE_FIELDS).execute(conn, rows)
        stored = conn.execute(
            select(STATES.c.rule_id, STATES.c.token, sql_cast(STATES.c.series, Text)).order_by(STATES.c.rule_id)
        ).all()
    assert [tuple(row) for row in stored] == [(rule_id, 7, dump_json(SERIES)) for rule_id in (1, 2, 3)]


def test_rows_read_are_cores_with_a_name_bound_twice(engine: Engine) -> None:
    _add_rules(engine, [True, False, True])
    with engine.begin() as conn:
        conn.execute(insert(STATES), [{"rule_id": 1, "run": "r", "rank": 0, "token": 11, "series": []}])
        conn.execute(insert(FIRING), [{"run": "r", "rank": 2, "token": 5}, {"run": "other", "rank": 0, "token": 6}])
    of_run = and_(STATES.c.rule_id == RULES.c.id, STATES.c.run == bindparam("run"), STATES.c.rank == bindparam("rank"))
    statement = union_all(
        select(literal_column("0"), RULES.c.id, STATES.c.token)
        .select_from(RULES.outerjoin(STATES, of_run))
        .where(RULES.c.enabled.is_(True)),
        select(literal_column("1"), FIRING.c.rank, FIRING.c.token).where(FIRING.c.run == bindparam("run")),
    )
    params = {"run": "r", "rank": 0}
    with engine.connect() as conn:
        core = sorted(tuple(row) for row in conn.execute(statement, params))
        driver = sorted(tuple(row) for row in DriverStatement(statement).execute(conn, params))
    assert driver == core == [(0, 1, 11), (0, 3, None), (1, 2, 5)]


def test_binaries_floats_and_returning_round_trip(engine: Engine) -> None:
    blobs = [np.arange(4, dtype="<f4").tobytes(), np.full(4, np.nan, dtype="<f4").tobytes()]
    with engine.begin() as conn:
        run_id = conn.execute(insert(Run).values(name="r", created_at=0.0, layer_count=4).returning(Run.id)).scalar()
        name_id = conn.execute(insert(MetricName).values(name="m").returning(MetricName.id)).scalar()
        dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
        batch = DriverStatement(
            dialect_insert(Batch).on_conflict_do_nothing().returning(Batch.batch_id),
            ("run_id", "batch_id", "rank", "received_at", "points"),
        )
        row = {"run_id": run_id, "batch_id": "b", "rank": 0, "received_at": 1.25, "points": 8}
        assert tuple(batch.execute(conn, row).one()) == ("b",)
        assert batch.execute(conn, row).first() is None  # a duplicate: nothing inserted, nothing returned
        points = DriverStatement(insert(Point), ("run_id", "rank", "step", "name_id", "time", "vals"))
        points.execute(
            conn,
            [
                {"run_id": run_id, "rank": 0, "step": step, "name_id": name_id, "time": 0.5 + step, "vals": blob}
                for step, blob in enumerate(blobs)
            ],
        )
        stored = conn.execute(select(Point.step, Point.time, Point.vals).order_by(Point.step)).all()
        received = conn.execute(select(Batch.received_at)).scalar()
    assert [(step, time, bytes(vals)) for step, time, vals in stored] == [(0, 0.5, blobs[0]), (1, 1.5, blobs[1])]
    assert received == 1.25


@pytest.mark.parametrize(
    ("statement", "columns", "refused"),
    [
        (select(RULES.c.id).where(RULES.c.id.in_(bindparam("ids", expanding=True))), (), "expanding"),
        (insert(RULES), ("name", "source", "definition", "updated_at"), "Python-side defaults"),
        (select(RULES.c.id).where(RULES.c.id == 3), (), "values bound into the statement"),
    ],
)
def test_a_statement_that_needs_cores_execution_is_refused(
    engine: Engine, statement: ClauseElement, columns: tuple[str, ...], refused: str
) -> None:
    with engine.connect() as conn, pytest.raises(ValueError, match=refused):
        DriverStatement(statement, columns).execute(conn, {"ids": [1], "name": "n", "source": "api"})


def test_a_result_column_core_converts_is_refused_where_core_converts_it(engine: Engine) -> None:
    """SQLite hands JSON back as text (Core parses it); psycopg parses it with the engine's loads itself."""
    _add_rules(engine, [True])
    statement = select(RULES.c.definition)
    with engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            with pytest.raises(ValueError, match="result columns"):
                DriverStatement(statement).execute(conn, {})
            return
        rows: list[Any] = [tuple(row) for row in DriverStatement(statement).execute(conn, {})]
        assert rows == [tuple(row) for row in conn.execute(statement)] == [({},)]
