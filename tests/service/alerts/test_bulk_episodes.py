"""The engine's bulk episode path in the database against the per-sample definitions replayed in memory."""

from __future__ import annotations

import json
import random

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import (
    SeriesState,
    SeriesStatus,
    StepInput,
    advance_episode,
    evaluate_batch,
)
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.tables import (
    AlertGroupRow,
    DeliveryRow,
    EpisodeRow,
    ReceiverRow,
    RuleRow,
    SeriesStatesRow,
)
from quantwatch.service.core.db import write_session

LAYERS = ["a", "b", "c", "d", "e"]
RULES = [
    Rule(name="dev", metric="output_rel_l2", op=">", threshold=0.05, consecutive=2),
    Rule(name="hold", metric="output_rel_l2", op=">", threshold=0.5, consecutive=1, keep_firing_for=1),
]

Batch = tuple[int, list[StepInput]]


def flapping_batches(seed: int, count: int) -> list[Batch]:
    """Batches of three ranks whose values cross both thresholds often; some steps are older, some unmeasured."""
    rng = random.Random(seed)
    newest = [0, 0, 0]
    batches = []
    for _ in range(count):
        rank = rng.randrange(3)
        first = newest[rank] + 1 if rng.random() > 0.15 else max(1, newest[rank] - 3)
        steps = []
        for step in range(first, first + rng.randint(1, 6)):
            values: list[float | None] = [
                None if rng.random() < 0.1 else rng.choice([0.0, 0.2, 0.9, float("nan")]) for _ in LAYERS
            ]
            steps.append(StepInput(step, 1_700_000_000.0 + step, {"output_rel_l2": values}, {}))
        newest[rank] = max(newest[rank], first + len(steps) - 1)
        rng.shuffle(steps)
        batches.append((rank, steps))
    return batches


Expected = tuple[
    dict[tuple[str, str], list[tuple[str, int, int | None, int | None, list[int]]]], list[tuple[str, str, str, int]]
]


def replay(batches: list[Batch]) -> Expected:
    """Episodes per (rule, layer) as (state, pending, firing, resolved step, ranks) and the notifications, in order."""
    states: dict[int, dict[tuple[str, str], SeriesState]] = {rank: {} for rank in range(3)}
    statuses: dict[tuple[str, str], dict[int, SeriesStatus]] = {}
    episodes: dict[tuple[str, str], list[list[object]]] = {}
    notes: list[tuple[str, str, str, int]] = []
    for rank, steps in batches:
        changed, moves = evaluate_batch(RULES, "run", rank, LAYERS, steps, states[rank])
        states[rank] = {**states[rank], **changed}
        for move in moves:
            key = (move.rule, move.layer)
            group = statuses.setdefault(key, {})
            group[rank] = move.after
            active = sorted(r for r, status in group.items() if status is not SeriesStatus.INACTIVE)
            history = episodes.setdefault(key, [])
            current = history[-1] if history and history[-1][0] != "resolved" else None
            step = move.sample.step
            for event in advance_episode(current[0] if current else None, group.values()):
                if event.kind == "open":
                    current = [event.state, step, step if event.state == "firing" else None, None, active]
                    history.append(current)
                    if event.state == "firing":
                        notes.append((*key, "firing", step))
                elif event.kind == "cancel" and current is not None:
                    history.pop()
                    current = None
                elif event.kind == "fire" and current is not None:
                    current[0], current[2] = "firing", step
                    current[4] = sorted(set(current[4]) | set(active))
                    notes.append((*key, "firing", step))
                elif event.kind == "resolve" and current is not None:
                    current[0], current[3] = "resolved", step
                    notes.append((*key, "resolved", step))
            if current is not None and current[0] != "resolved":
                current[4] = sorted(set(current[4]) | set(active))
    expected = {key: [tuple(item) for item in history] for key, history in episodes.items() if history}
    return expected, notes


def setup_rules(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        for rule in RULES:
            session.add(RuleRow(name=rule.name, source="api", definition=rule.model_dump(mode="json"), updated_at=0.0))
        session.add(
            ReceiverRow(
                name="ops", source="api", type="webhook", url="http://127.0.0.1:9/h", secrets=[], updated_at=0.0
            )
        )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bulk_episodes_match_the_definitions(engine: Engine, seed: int) -> None:
    sessions = sessionmaker(engine)
    setup_rules(sessions)
    alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    batches = flapping_batches(seed, 40)
    written = 0
    for rank, steps in batches:
        with write_session(sessions) as session:
            written += alerts.evaluate(session, "run", rank, LAYERS, steps)
    expected, notes = replay(batches)
    assert len(notes) > 20  # the workload does flap
    with sessions() as session:
        got: dict[tuple[str, str], list[tuple[object, ...]]] = {}
        for row in session.scalars(select(EpisodeRow).order_by(EpisodeRow.id)):
            got.setdefault((row.rule_name, row.layer), []).append(
                (row.state, row.pending_step, row.firing_step, row.resolved_step, list(row.ranks))
            )
        assert got == expected
        open_ids = {
            (rule_name, layer): episode_id
            for rule_name, layer, episode_id in session.execute(
                select(RuleRow.name, AlertGroupRow.layer, AlertGroupRow.episode_id).join(
                    RuleRow, RuleRow.id == AlertGroupRow.rule_id
                )
            )
        }
        for row in session.scalars(select(EpisodeRow)):
            is_open = row.state != "resolved"
            assert (open_ids[(row.rule_name, row.layer)] == row.id) == is_open
        assert written == len(notes) == session.scalar(select(func.count()).select_from(DeliveryRow))
        received = sorted(
            (
                json.loads(text)["commonLabels"]["alertname"],
                json.loads(text)["commonLabels"]["layer"],
                event,
                json.loads(text)["quantwatch"]["step"],
            )
            for event, text in session.execute(select(DeliveryRow.event, DeliveryRow.body))
        )
        assert received == sorted(notes)
        for episode_id, event in session.execute(select(DeliveryRow.episode_id, DeliveryRow.event)):
            episode = session.get(EpisodeRow, episode_id)
            assert episode is not None
            assert event == "firing" or episode.state == "resolved"


def test_failed_batch_keeps_no_alert_state(engine: Engine) -> None:
    """A batch whose transaction fails after evaluation leaves series, groups, episodes and the outbox untouched."""
    sessions = sessionmaker(engine)
    setup_rules(sessions)
    alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    steps = [StepInput(step, float(step), {"output_rel_l2": [0.9] * len(LAYERS)}, {}) for step in (1, 2, 3)]

    def evaluate_then_fail() -> None:
        with write_session(sessions) as session:
            assert alerts.evaluate(session, "run", 0, LAYERS, steps) == 2 * len(LAYERS)
            raise RuntimeError("storage failed")

    with pytest.raises(RuntimeError, match="storage failed"):
        evaluate_then_fail()
    with sessions() as session:
        for table in (SeriesStatesRow, AlertGroupRow, EpisodeRow, DeliveryRow):
            assert session.scalar(select(func.count()).select_from(table)) == 0
    with write_session(sessions) as session:
        assert alerts.evaluate(session, "run", 0, LAYERS, steps) == 2 * len(LAYERS)
    leased, unleased = alerts.take_enqueued()
    with sessions() as session:
        assert sorted(leased + unleased) == sorted(session.scalars(select(DeliveryRow.id)))
