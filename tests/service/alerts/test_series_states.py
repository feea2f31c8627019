"""Series states stored one row per (rule, run, rank) (migration 0008): carried over both ways, and safe between
replicas that each keep the states they wrote last."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.orm import sessionmaker

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.alerts import repository
from quantwatch.service.alerts.columns import COLUMNS_TAG
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import SeriesState, SeriesStatus, StepInput, evaluate_batch
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.tables import DeliveryRow, RuleRow, SeriesStatesRow
from quantwatch.service.batch import decode_json
from quantwatch.service.core.db import alembic_config, make_engine, upgrade, write_session
from tests.service.alerts.test_bulk_episodes import LAYERS, RULES, flapping_batches, replay, setup_rules
from tests.service.conftest import batch_doc

RULE = Rule(name="high", metric="output_rel_l2", op=">", threshold=0.5, consecutive=3)
COLUMNS = ("r", "run", "rank", "layer", "status", "last_step", "streak", "clear", "value", "baseline", "since")
OLD_ROWS = [
    # rule_id, run, rank, layer, status, last_step, streak, clear_streak, last_value, baseline, baseline_since
    (1, "old", 0, "a", "pending", 7, 2, 0, 0.75, None, None),
    (1, "old", 0, "b", "inactive", 7, 0, 0, 0.125, None, None),
    (1, "old", 1, "a", "firing", 9, 0, 1, None, None, None),
    (1, "other", 0, "", "inactive", None, 0, 0, None, "[0.5, 0.25]", 3),
]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


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
            command.upgrade(cfg, "0008_whatif")
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
                1: (
                    0,
                    {
                        ("high", "a"): SeriesState(SeriesStatus.PENDING, 7, 2, 0, 0.75),
                        ("high", "b"): SeriesState(SeriesStatus.INACTIVE, 7, 0, 0, 0.125),
                    },
                )
            }
            assert repository.read_series_states(session, "old", 1, {1: "high"}) == {
                1: (0, {("high", "a"): SeriesState(SeriesStatus.FIRING, 9, 0, 1, None)})
            }
            assert repository.read_series_states(session, "other", 0, {1: "high"}) == {
                1: (0, {("high", ""): SeriesState(SeriesStatus.INACTIVE, None, 0, 0, None, (0.5, 0.25), 3)})
            }
        # The engine goes on from the migrated state: a third breach of layer a on rank 0 fires.
        alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
        with write_session(sessions) as session:
            alerts.evaluate(session, "old", 0, ["a", "b"], [StepInput(8, 8.0, {"output_rel_l2": [0.9, 0.1]}, {})])
        with sessions() as session:
            token, after = repository.read_series_states(session, "old", 0, {1: "high"})[1]
        assert token > 0
        assert after[("high", "a")] == SeriesState(SeriesStatus.FIRING, 8, 3, 0, 0.9)
        assert after[("high", "b")] == SeriesState(SeriesStatus.INACTIVE, 8, 0, 0, 0.1)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0008_whatif")
        with engine.connect() as conn:
            back = _rows(conn)
        moved = {(1, "old", 0, "a"): ("firing", 8, 3, 0, 0.9), (1, "old", 0, "b"): ("inactive", 8, 0, 0, 0.1)}
        expected = [(*row[:4], *moved.get(row[:4], row[4:9]), *row[9:]) for row in before]
        assert [row[:9] for row in back] == [row[:9] for row in expected]
        assert [row[10] for row in back] == [row[10] for row in expected]
        assert json.loads(str(back[3][9])) == [0.5, 0.25]
    finally:
        engine.dispose()


@pytest.mark.parametrize("seed", [4, 5])
def test_replicas_taking_turns_on_the_same_ranks_keep_the_definitions_states(
    engine: Engine, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines on one database (two replicas) take the batches of the same ranks in turn, at random: each reuses
    the states it wrote last only while its row's token is still the one it drew, so what they store is what the
    definition gives, and every notification of the replayed episodes is written once."""
    sessions = sessionmaker(engine)
    setup_rules(sessions)
    reads: list[int] = []
    read = repository.read_series_states

    def counted(*args: Any) -> repository.StoredStates:
        reads.append(args[2])
        return read(*args)

    monkeypatch.setattr(repository, "read_series_states", counted)
    replicas = [AlertEngine(external_url="http://x", delivery_horizon_seconds=60) for _ in range(2)]
    turns = random.Random(seed)
    batches = flapping_batches(seed, 40)
    committed = decode_json(json.dumps(batch_doc("run", LAYERS, [1], {})).encode())  # after_commit reads no field
    for rank, steps in batches:
        alerts = replicas[turns.randrange(2)]
        with write_session(sessions) as session:
            alerts.evaluate(session, "run", rank, LAYERS, steps)
        alerts.after_commit(committed)
    assert 0 < len(reads) < len(batches)  # some turns found their own states current, others read the database
    expected: dict[int, dict[tuple[str, str], SeriesState]] = {}
    for rank, steps in batches:
        changed, _ = evaluate_batch(RULES, "run", rank, LAYERS, steps, expected.setdefault(rank, {}))
        expected[rank].update(changed)
    stored_as = {  # a non-finite last value is stored as null
        rank: {key: replace(state, last_value=_finite(state.last_value)) for key, state in states.items()}
        for rank, states in expected.items()
    }
    with sessions() as session:
        names = {row.id: row.name for row in session.scalars(select(RuleRow))}
        for rank, states in stored_as.items():
            stored = read(session, "run", rank, names)
            assert {key: state for _, rows in stored.values() for key, state in rows.items()} == states
        assert session.scalar(select(func.count()).select_from(DeliveryRow)) == len(replay(batches)[1])


def test_a_ranks_columns_follow_its_changing_layer_list(engine: Engine) -> None:
    """One rank's batches list layers added, dropped and reordered: the columnar rows it writes (one per rule) read
    back as the per-sample definition's states, and a batch whose samples are all older writes nothing."""
    sessions = sessionmaker(engine)
    setup_rules(sessions)
    alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    batches = [
        (["a", "b", "c"], [StepInput(10, 10.0, {"output_rel_l2": [0.9, 0.2, float("nan")]}, {})]),
        (["c", "a"], [StepInput(20, 20.0, {"output_rel_l2": [0.0, 0.9]}, {})]),
        (["d", "b", "a"], [StepInput(30, 30.0, {"output_rel_l2": [0.9, None, 0.2]}, {})]),
        (["a", "d"], [StepInput(5, 5.0, {"output_rel_l2": [0.9, 0.9]}, {})]),
    ]
    expected: dict[tuple[str, str], SeriesState] = {}
    tokens = []
    for layers, steps in batches:
        with write_session(sessions) as session:
            alerts.evaluate(session, "run", 0, layers, steps)
        expected.update(evaluate_batch(RULES, "run", 0, layers, steps, expected)[0])
        with sessions() as session:
            names = {row.id: row.name for row in session.scalars(select(RuleRow))}
            stored = repository.read_series_states(session, "run", 0, names)
        tokens.append(sorted(token for token, _ in stored.values()))
        as_stored = {key: replace(state, last_value=_finite(state.last_value)) for key, state in expected.items()}
        assert {key: state for _, rows in stored.values() for key, state in rows.items()} == as_stored
    assert tokens[3] == tokens[2]
    with sessions() as session:
        assert [series[0] for series in session.scalars(select(SeriesStatesRow.series))] == [COLUMNS_TAG] * 2
