"""Migration 0008: the per-series alert state rows become one row per (rule, run, rank), and back, with their data."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.orm import sessionmaker

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.alerts import repository
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import SeriesState, SeriesStatus, StepInput
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.core.db import alembic_config, make_engine, upgrade, write_session

RULE = Rule(name="high", metric="output_rel_l2", op=">", threshold=0.5, consecutive=3)
COLUMNS = ("r", "run", "rank", "layer", "status", "last_step", "streak", "clear", "value", "baseline", "since")
OLD_ROWS = [
    # rule_id, run, rank, layer, status, last_step, streak, clear_streak, last_value, baseline, baseline_since
    (1, "old", 0, "a", "pending", 7, 2, 0, 0.75, None, None),
    (1, "old", 0, "b", "inactive", 7, 0, 0, 0.125, None, None),
    (1, "old", 1, "a", "firing", 9, 0, 1, None, None, None),
    (1, "other", 0, "", "inactive", None, 0, 0, None, "[0.5, 0.25]", 3),
]


def _rows(conn: Connection) -> list[tuple[Any, ...]]:
    query = text(
        "SELECT rule_id, run, rank, layer, status, last_step, streak, clear_streak, last_value, baseline, "
        "baseline_since FROM alert_series ORDER BY rule_id, run, rank, layer"
    )
    rows = [tuple(row) for row in conn.execute(query)]
    # PostgreSQL answers the JSON column parsed, SQLite as text.
    return [(*row[:9], row[9] if row[9] is None or isinstance(row[9], str) else str(row[9]), row[10]) for row in rows]


def test_migration_0008_carries_series_states_over_both_ways(empty_database_url: str) -> None:
    engine = make_engine(Settings(database_url=empty_database_url))
    cfg = alembic_config(empty_database_url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0007_rollup_frontier")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO alert_rules (id, name, source, definition, enabled, revision, updated_at) "
                    "VALUES (1, 'high', 'api', :definition, true, 1, 1.0)"
                ),
                {"definition": json.dumps(RULE.model_dump(mode="json"))},
            )
            for row in OLD_ROWS:
                conn.execute(
                    text(
                        "INSERT INTO alert_series (rule_id, run, rank, layer, status, last_step, streak, "
                        "clear_streak, last_value, baseline, baseline_since) VALUES (:r, :run, :rank, :layer, "
                        ":status, :last_step, :streak, :clear, :value, :baseline, :since)"
                    ),
                    dict(zip(COLUMNS, row, strict=True)),
                )
            before = _rows(conn)
        upgrade(engine)
        sessions = sessionmaker(engine)
        with sessions() as session:
            stored = repository.read_series_states(session, "old", 0, {1: "high"})
            assert stored == {
                ("high", "a"): SeriesState(SeriesStatus.PENDING, 7, 2, 0, 0.75),
                ("high", "b"): SeriesState(SeriesStatus.INACTIVE, 7, 0, 0, 0.125),
            }
            assert repository.read_series_states(session, "old", 1, {1: "high"}) == {
                ("high", "a"): SeriesState(SeriesStatus.FIRING, 9, 0, 1, None)
            }
            assert repository.read_series_states(session, "other", 0, {1: "high"}) == {
                ("high", ""): SeriesState(SeriesStatus.INACTIVE, None, 0, 0, None, (0.5, 0.25), 3)
            }
        # The engine goes on from the migrated state: a third breach of layer a on rank 0 fires.
        alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
        with write_session(sessions) as session:
            alerts.evaluate(session, "old", 0, ["a", "b"], [StepInput(8, 8.0, {"output_rel_l2": [0.9, 0.1]}, {})])
        with sessions() as session:
            after = repository.read_series_states(session, "old", 0, {1: "high"})
        assert after[("high", "a")] == SeriesState(SeriesStatus.FIRING, 8, 3, 0, 0.9)
        assert after[("high", "b")] == SeriesState(SeriesStatus.INACTIVE, 8, 0, 0, 0.1)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0007_rollup_frontier")
        with engine.connect() as conn:
            back = _rows(conn)
        moved = {(1, "old", 0, "a"): ("firing", 8, 3, 0, 0.9), (1, "old", 0, "b"): ("inactive", 8, 0, 0, 0.1)}
        expected = [(*row[:4], *moved.get(row[:4], row[4:9]), *row[9:]) for row in before]
        assert [row[:9] for row in back] == [row[:9] for row in expected]
        assert [row[10] for row in back] == [row[10] for row in expected]
        assert json.loads(str(back[3][9])) == [0.5, 0.25]
    finally:
        engine.dispose()
