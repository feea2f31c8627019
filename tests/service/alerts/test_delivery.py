"""Evaluation into the database and delivery through the outbox to a real HTTP receiver on loopback."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from quantwatch.service.alerts.catalog import put_rule, sync_rules_file
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import StepInput
from quantwatch.service.alerts.outbox import DeliveryWorker, RetryPolicy, parse_retry_after
from quantwatch.service.alerts.rules import Rule, parse_rules_text
from quantwatch.service.alerts.tables import DeliveryRow, EpisodeRow, ReceiverRow, RuleRow
from quantwatch.service.core.db import write_session


def add_rule(sessions: sessionmaker[Session], rule: Rule) -> None:
    with sessions.begin() as session:
        session.add(RuleRow(name=rule.name, source="api", definition=rule.model_dump(mode="json"), updated_at=0.0))


def add_receiver(
    sessions: sessionmaker[Session], name: str, url: str, secrets: list[str], kind: str = "webhook"
) -> None:
    with sessions.begin() as session:
        session.add(
            ReceiverRow(
                name=name, source="api", type=kind, url=url, secrets=secrets, headers={"x-team": "ml"}, updated_at=0.0
            )
        )


def ingest(
    engine_: AlertEngine,
    sessions: sessionmaker[Session],
    run: str,
    rank: int,
    layers: list[str],
    rows: list[tuple[int, list[float | None]]],
) -> int:
    steps = [StepInput(step, 1_700_000_000.0 + step, {"output_rel_l2": values}, {}) for step, values in rows]
    with write_session(sessions) as session:
        written = engine_.evaluate(session, run, rank, layers, steps)
    engine_.send_enqueued()
    return written


RULE = Rule(name="dev", metric="output_rel_l2", op=">", threshold=0.05, consecutive=3)


def test_episode_fires_once_and_resolves_with_signed_webhooks(
    engine: Engine, receivers: Callable[..., Any], whsec: Callable[[], str]
) -> None:
    sessions = sessionmaker(engine)
    secret = whsec()
    receiver = receivers()
    add_rule(sessions, RULE)
    add_receiver(sessions, "ops", receiver.url, [secret])
    worker = DeliveryWorker(sessions, poll_seconds=0.05)
    alerts = AlertEngine(
        external_url="http://127.0.0.1:8000",
        delivery_horizon_seconds=3600,
        wake=worker.wake,
        dispatch=worker.dispatch,
    )
    worker.start()
    try:
        assert ingest(alerts, sessions, "gpt", 0, ["a", "b"], [(1, [0.1, 0.0]), (2, [0.1, 0.0])]) == 0
        assert ingest(alerts, sessions, "gpt", 1, ["a", "b"], [(1, [0.2, 0.0]), (2, [0.2, 0.0]), (3, [0.2, None])]) == 1
        assert ingest(alerts, sessions, "gpt", 0, ["a", "b"], [(3, [0.1, 0.0]), (2, [0.9, 0.9])]) == 0
        assert ingest(alerts, sessions, "gpt", 1, ["a", "b"], [(4, [0.0, 0.0])]) == 0
        assert ingest(alerts, sessions, "gpt", 0, ["a", "b"], [(4, [0.01, 0.0])]) == 1
        requests = receiver.wait_for(2)
    finally:
        worker.stop()
        receiver.stop()
    assert len(requests) == 2
    bodies = [Webhook(secret).verify(body, headers) for headers, body in requests]
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    assert bodies[0]["quantwatch"]["ranks"] == [0, 1]
    assert bodies[0]["quantwatch"]["step"] == 3
    assert bodies[1]["quantwatch"]["step"] == 4
    assert all(headers["x-team"] == "ml" for headers, _ in requests)
    assert len({headers["webhook-id"] for headers, _ in requests}) == 2
    with sessions() as session:
        episode = session.scalars(select(EpisodeRow)).one()
        assert (episode.state, episode.layer, episode.pending_step, episode.firing_step, episode.resolved_step) == (
            "resolved",
            "a",
            1,
            3,
            4,
        )
        assert session.scalar(select(func.count()).where(DeliveryRow.status == "delivered")) == 2


def test_receiver_down_then_back_gets_each_webhook_once(
    engine: Engine, receivers: Callable[..., Any], whsec: Callable[[], str]
) -> None:
    sessions = sessionmaker(engine)
    receiver = receivers(start=False)
    add_rule(sessions, RULE.model_copy(update={"consecutive": 1}))
    add_receiver(sessions, "ops", receiver.url, [whsec()])
    alerts = AlertEngine(external_url="http://127.0.0.1:8000", delivery_horizon_seconds=3600)
    worker = DeliveryWorker(sessions, poll_seconds=0.05, policy=RetryPolicy(base_seconds=0.05, max_seconds=0.4))
    layers = [f"l{i}" for i in range(10)]
    worker.start()
    try:
        written = ingest(alerts, sessions, "r", 0, layers, [(1, [1.0] * 10), (2, [0.0] * 10)])
        assert written == 20
        time.sleep(1.0)  # the receiver is down: connection refused, retried with backoff
        receiver.answers = [(503, {})] * 3
        receiver.start()
        requests = receiver.wait_for(23)
        time.sleep(0.5)
    finally:
        worker.stop()
        receiver.stop()
    delivered = [webhook_id for webhook_id, code, _ in receiver.answered if code == 204]
    refused = {webhook_id for webhook_id, code, _ in receiver.answered if code == 503}
    assert refused
    assert refused <= set(delivered)  # a retry carries the webhook-id of the refused attempt
    assert len(delivered) == 20
    assert len(set(delivered)) == 20
    with sessions() as session:
        rows = session.scalars(select(DeliveryRow)).all()
        assert {row.status for row in rows} == {"delivered"}
        assert {row.webhook_id for row in rows} == set(delivered)
        assert max(row.attempts for row in rows) >= 2
        # firing strictly before resolved for every episode
        order = {json.loads(body)["quantwatch"]["episode_id"]: [] for _, body in requests}
        for _, code, body in receiver.answered:
            if code != 204:
                continue
            payload = json.loads(body)
            order[payload["quantwatch"]["episode_id"]].append(payload["status"])
        assert all(statuses == ["firing", "resolved"] for statuses in order.values())


def test_gone_disables_receiver_and_retry_after_is_honoured(engine: Engine, receivers: Callable[..., Any]) -> None:
    sessions = sessionmaker(engine)
    gone, slow = receivers(), receivers()
    gone.answers = [(410, {})]
    slow.answers = [(429, {"Retry-After": "2"})]
    add_rule(sessions, RULE.model_copy(update={"consecutive": 1}))
    add_receiver(sessions, "gone", gone.url, [])
    add_receiver(sessions, "slow", slow.url, [])
    alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=3600)
    worker = DeliveryWorker(sessions, policy=RetryPolicy(base_seconds=0.01, max_seconds=0.01))
    try:
        ingest(alerts, sessions, "r", 0, ["a"], [(1, [1.0])])
        started = time.time()
        assert worker.run_once() == 2
        with sessions() as session:
            receivers = {r.name: r for r in session.scalars(select(ReceiverRow))}
            assert not receivers["gone"].enabled
            assert "410" in (receivers["gone"].disabled_reason or "")
            retry = session.scalars(select(DeliveryRow).where(DeliveryRow.receiver_id == receivers["slow"].id)).one()
            assert retry.status == "pending"
            assert retry.next_attempt_at >= started + 2.0
        assert worker.run_once() == 0
        ingest(alerts, sessions, "r", 0, ["a"], [(2, [0.0])])
        with sessions() as session:
            events = session.execute(select(DeliveryRow.event, ReceiverRow.name).join(ReceiverRow)).all()
            assert sorted(events) == [("firing", "gone"), ("firing", "slow"), ("resolved", "slow")]
    finally:
        worker.stop()
        gone.stop()
        slow.stop()


def test_restarted_engine_does_not_fire_twice(engine: Engine) -> None:
    sessions = sessionmaker(engine)
    add_rule(sessions, RULE)
    add_receiver(sessions, "ops", "http://127.0.0.1:9/never", [])
    first = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    assert ingest(first, sessions, "r", 0, ["a"], [(1, [1.0]), (2, [1.0])]) == 0
    second = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    assert ingest(second, sessions, "r", 0, ["a"], [(3, [1.0]), (4, [1.0])]) == 1
    third = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    assert ingest(third, sessions, "r", 0, ["a"], [(4, [1.0]), (5, [1.0]), (3, [0.0])]) == 0
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(EpisodeRow)) == 1
        assert session.scalar(select(func.count()).select_from(DeliveryRow)) == 1


def test_retries_stop_at_the_horizon(engine: Engine, receivers: Callable[..., Any]) -> None:
    sessions = sessionmaker(engine)
    down = receivers(start=False)
    add_rule(sessions, RULE.model_copy(update={"consecutive": 1}))
    add_receiver(sessions, "down", down.url, [])
    # One clock for the engine (which sets the horizon) and the worker, moved 30 ms a round: how many attempts fit
    # does not depend on how long a round takes on a loaded machine.
    now = [time.time()]
    alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=0.4, clock=lambda: now[0])
    worker = DeliveryWorker(sessions, policy=RetryPolicy(base_seconds=0.05, max_seconds=0.1), clock=lambda: now[0])
    try:
        ingest(alerts, sessions, "r", 0, ["a"], [(1, [1.0])])
        for _ in range(100):
            worker.run_once()
            with sessions() as session:
                row = session.scalars(select(DeliveryRow)).one()
            if row.status != "pending":
                break
            now[0] += 0.03
    finally:
        worker.stop()
    assert row.status == "failed"
    assert row.attempts >= 2
    assert "horizon" in (row.last_error or "")


def test_retry_after_and_backoff() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7", now) == 7.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:40 GMT", now) == pytest.approx(20.0)
    assert parse_retry_after("soon", now) is None
    policy = RetryPolicy(base_seconds=1.0, max_seconds=60.0)
    rng = random.Random(5)
    delays = [policy.delay(attempt, None, rng) for attempt in range(1, 10)]
    assert all(0.5 * min(60.0, 2 ** (a - 1)) <= d <= min(60.0, 2 ** (a - 1)) for a, d in enumerate(delays, start=1))
    assert policy.delay(1, 30.0, rng) == 30.0
    with pytest.raises(ValueError, match="base_seconds"):
        RetryPolicy(base_seconds=0.0)


def test_rules_file_sync_retires_changed_rules(engine: Engine) -> None:
    sessions = sessionmaker(engine)
    alerts = AlertEngine(external_url="http://x", delivery_horizon_seconds=60)
    first = parse_rules_text(
        "receivers:\n  - {name: hook, url: 'http://127.0.0.1:9/h'}\n"
        "rules:\n  - {name: x, metric: amax, op: '>', threshold: 1, consecutive: 1}\n"
    )
    with write_session(sessions) as session:
        sync_rules_file(session, alerts, first)
    with write_session(sessions) as session:
        put_rule(session, alerts, Rule(name="mine", metric="amax", op="<", threshold=0, consecutive=1), create=True)
    steps = [StepInput(1, 1.0, {"amax": [5.0]}, {})]
    with write_session(sessions) as session:
        assert alerts.evaluate(session, "r", 0, ["a"], steps) == 1
    changed = parse_rules_text(
        "default_rules: false\nreceivers:\n  - {name: hook, url: 'http://127.0.0.1:9/h'}\n"
        "rules:\n  - {name: x, metric: amax, op: '>', threshold: 10, consecutive: 1}\n"
    )
    with write_session(sessions) as session:
        sync_rules_file(session, alerts, changed)
    with sessions() as session:
        rules = {
            row.name: (row.source, row.revision, row.definition["threshold"])
            for row in session.scalars(select(RuleRow))
        }
        assert rules == {"x": ("file", 2, 10.0), "mine": ("api", 1, 0.0)}
        episode = session.scalars(select(EpisodeRow)).one()
        assert episode.state == "resolved"
        assert episode.annotations["resolved_reason"] == "rules file changed"
        assert sorted(session.scalars(select(DeliveryRow.event))) == ["firing", "resolved"]
    with write_session(sessions) as session:
        assert alerts.evaluate(session, "r", 0, ["a"], [StepInput(2, 2.0, {"amax": [5.0]}, {})]) == 0
