"""Columnar series states in version 2 (migration 0016): compact rows that read back exactly, old rows still read and
carried on, and the downgrade that gives the code before it version 1 again."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import sessionmaker

from alembic import command
from quantwatch.service import Settings
from quantwatch.service.alerts import repository
from quantwatch.service.alerts.columns import ColumnStates, stored_statuses
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import SeriesState, StepInput, evaluate_batch
from quantwatch.service.alerts.state_codec import COLUMNS_TAG, COLUMNS_V1_TAG
from quantwatch.service.alerts.tables import RuleRow, SeriesStatesRow
from quantwatch.service.core.db import alembic_config, make_engine, upgrade, write_session
from tests.service.alerts.test_bulk_episodes import RULES, setup_rules

LAYERS = [f"blocks.{i // 8}.{['attn.qkv', 'mlp.fc1', 'norm1', 'gate'][i % 4]}.{i % 8}" for i in range(512)]


def _states(rng: np.random.Generator, count: int, values: np.ndarray) -> ColumnStates:
    return ColumnStates(
        "r",
        tuple(f'layer "{i}"\n{"é" * (i % 3)}' for i in range(count)),
        rng.random(count) < 0.8,
        rng.integers(0, 3, count).astype(np.int8),
        rng.integers(0, 2**62, count),
        rng.integers(0, 2**40, count),
        rng.integers(0, 50, count),
        values,
    )


def _version_1(states: ColumnStates) -> list[object]:
    """The row the code before migration 0016 wrote (non-finite values as null)."""
    values = [value if math.isfinite(value) else None for value in states.last_value.tolist()]
    return [
        COLUMNS_V1_TAG,
        list(states.layers),
        states.seen.tolist(),
        states.status.tolist(),
        states.last.tolist(),
        states.streak.tolist(),
        states.clear.tolist(),
        values,
    ]


def _same(left: ColumnStates, right: ColumnStates) -> bool:
    arrays = zip(left._arrays(), right._arrays(), strict=True)
    return left.layers == right.layers and all(np.array_equal(a, b, equal_nan=True) for a, b in arrays)


@pytest.mark.parametrize("count", [0, 1, 7, 9, 512])
@pytest.mark.parametrize("wide", [False, True])
def test_version_2_rows_read_back_every_field_exactly(count: int, wide: bool) -> None:
    """Any layer names, steps and streaks up to 2**62, float32 values or not, non-finite ones kept: the stored row
    (through JSON, as the column stores it) reads back as the states it was made of, and its statuses as version 1's
    do."""
    rng = np.random.default_rng(count * 2 + wide)
    values = rng.random(count, dtype=np.float32).astype(np.float64)
    if wide and count:
        values[0] = 0.1  # not a float32: every value is kept as float64
    for position, special in zip(range(1, count, 3), [math.inf, -math.inf, math.nan], strict=False):
        values[position] = special
    states = _states(rng, count, values)
    stored = json.loads(json.dumps(states.encode()))
    assert stored[0] == COLUMNS_TAG
    back = ColumnStates.decode("r", stored)
    assert _same(back, states)
    wanted = list(states.layers[::2])
    assert stored_statuses(stored, wanted) == stored_statuses(_version_1(states), wanted)
    assert {key: back[key] for key in back} == {key: states[key] for key in states}


def test_a_version_2_row_is_a_fraction_of_version_1() -> None:
    """512 layers of float32 values, the usual case: a sixth of the JSON lists of version 1."""
    rng = np.random.default_rng(0)
    values = (rng.random(512, dtype=np.float32) * np.float32(0.04)).astype(np.float64)
    none = ColumnStates.empty("r", LAYERS)
    states = ColumnStates("r", none.layers, ~none.seen, none.status, none.last + 12345, none.streak, none.clear, values)
    old, new = json.dumps(_version_1(states)), json.dumps(states.encode())
    assert len(new) * 6 < len(old)
    assert _same(ColumnStates.decode("r", json.loads(old)), states)


def test_the_engine_carries_on_from_a_version_1_row_and_rewrites_it(engine: Engine) -> None:
    """A row written before migration 0016 is read by an engine that never saw it (a restart) and carried on as the
    per-sample definition carries on; the row written after it is version 2."""
    sessions = sessionmaker(engine)
    setup_rules(sessions)
    layers = ["a", "b", "c", "d", "e"]
    first = [StepInput(10, 10.0, {"output_rel_l2": [0.9, 0.06, 0.0, None, float("inf")]}, {})]
    expected, _ = evaluate_batch(RULES, "run", 0, layers, first, {})
    with write_session(sessions) as session:
        ids = {row.name: row.id for row in session.scalars(select(RuleRow))}
        for rule in RULES:
            states = ColumnStates.from_states(rule.name, expected)
            row = SeriesStatesRow(rule_id=ids[rule.name], run="run", rank=0, token=7, series=_version_1(states))
            session.add(row)
    second = [StepInput(11, 11.0, {"output_rel_l2": [0.9, 0.9, 0.7, 0.9, 0.0]}, {})]
    with write_session(sessions) as session:
        AlertEngine(external_url="http://x", delivery_horizon_seconds=60).evaluate(session, "run", 0, layers, second)
    expected.update(evaluate_batch(RULES, "run", 0, layers, second, expected)[0])
    with sessions() as session:
        stored = repository.read_series_states(session, "run", 0, {rule_id: name for name, rule_id in ids.items()})
        tags = {series[0] for series in session.scalars(select(SeriesStatesRow.series))}
    assert tags == {COLUMNS_TAG}
    as_stored = {key: _finite(state) for key, state in expected.items()}
    assert {key: state for _, states in stored.values() for key, state in states.items()} == as_stored


def _finite(state: SeriesState) -> SeriesState:
    """The state as a stored row reads it: a non-finite last value as None."""
    value = state.last_value
    return state if value is None or math.isfinite(value) else replace(state, last_value=None)


def test_migration_0016_gives_version_1_back_and_takes_it_again(empty_database_url: str) -> None:
    """Rows the engine wrote at head (version 2) are version 1 after the downgrade to 0015, holding the same states;
    upgraded again, they read the same and the engine goes on from them."""
    engine = make_engine(Settings(database_url=empty_database_url))
    cfg = alembic_config(empty_database_url)
    try:
        upgrade(engine)
        sessions = sessionmaker(engine)
        setup_rules(sessions)
        alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
        rng = random.Random(3)
        for step in range(1, 6):
            for rank in range(2):
                values = [rng.choice([0.0, 0.1, 0.7, float("nan"), None]) for _ in LAYERS]
                batch = [StepInput(step, float(step), {"output_rel_l2": values}, {})]
                with write_session(sessions) as session:
                    alerts.evaluate(session, "run", rank, LAYERS, batch)
        with sessions() as session:
            names = {row.id: row.name for row in session.scalars(select(RuleRow))}
            before = {rank: repository.read_series_states(session, "run", rank, names) for rank in range(2)}
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0015_lean_storage")
        with sessions() as session:
            rows = list(session.execute(select(SeriesStatesRow.rule_id, SeriesStatesRow.rank, SeriesStatesRow.series)))
        assert len(rows) == 2 * len(RULES)
        for rule_id, rank, series in rows:
            assert series[0] == COLUMNS_V1_TAG
            old = ColumnStates.decode(names[rule_id], series)
            assert _same(old, ColumnStates.from_states(names[rule_id], before[rank][rule_id][1]))
        upgrade(engine)
        with sessions() as session:
            after = {rank: repository.read_series_states(session, "run", rank, names) for rank in range(2)}
        assert {rank: {i: dict(s) for i, (_, s) in rows.items()} for rank, rows in after.items()} == {
            rank: {i: dict(s) for i, (_, s) in rows.items()} for rank, rows in before.items()
        }
        batch = [StepInput(6, 6.0, {"output_rel_l2": [0.9] * len(LAYERS)}, {})]
        with write_session(sessions) as session:
            AlertEngine(external_url="http://x", delivery_horizon_seconds=60).evaluate(session, "run", 0, LAYERS, batch)
        with sessions() as session:
            moved = repository.read_series_states(session, "run", 0, names)
        assert {state.last_step for _, states in moved.values() for state in states.values()} == {6}
    finally:
        engine.dispose()
