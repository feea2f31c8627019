"""Evaluation into the database and delivery through the outbox to a real HTTP receiver on loopback."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import StepInput
from quantwatch.service.alerts.outbox import DeliveryWorker, RetryPolicy
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.tables import DeliveryRow, EpisodeRow, ReceiverRow, RuleRow
from quantwatch.service.models import Base

PG_URL = os.environ.get("QUANTWATCH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Receiver:
    """A webhook receiver on loopback that records each request; ``answer`` picks the status code."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.answers: list[tuple[int, dict[str, str]]] = []
        self.arrived = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                code, headers = owner.answers.pop(0) if owner.answers else (204, {})
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", "0")
                self.end_headers()
                with owner.arrived:
                    owner.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    owner.arrived.notify_all()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, count: int, timeout: float = 20.0) -> list[tuple[dict[str, str], bytes]]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < count and time.monotonic() < deadline:
                self.arrived.wait(deadline - time.monotonic())
            return list(self.requests)


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def _postgres_db() -> Iterator[str]:
    name = f"qw_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = PG_URL.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    try:
        connection = psycopg.connect(admin, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("QUANTWATCH_REQUIRE_POSTGRES") == "1":
            raise
        pytest.skip(f"PostgreSQL unreachable at {admin}: {exc}")
    with connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/alerts.db"
        generator = None
    else:
        generator = _postgres_db()
        url = next(generator)
    db = create_engine(url)
    Base.metadata.create_all(db)
    yield db
    db.dispose()
    if generator is not None:
        next(generator, None)


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
    with sessions.begin() as session:
        return engine_.evaluate(session, run, rank, layers, steps)


RULE = Rule(name="dev", metric="output_rel_l2", op=">", threshold=0.05, consecutive=3)


def test_episode_fires_once_and_resolves_with_signed_webhooks(engine: Engine) -> None:
    sessions = sessionmaker(engine)
    secret = new_secret()
    receiver = Receiver().start()
    add_rule(sessions, RULE)
    add_receiver(sessions, "ops", receiver.url, [secret])
    alerts = AlertEngine(external_url="http://127.0.0.1:8000", delivery_horizon_seconds=3600)
    worker = DeliveryWorker(sessions, poll_seconds=0.05)
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


def test_receiver_down_then_back_gets_each_webhook_once(engine: Engine) -> None:
    sessions = sessionmaker(engine)
    receiver = Receiver()
    add_rule(sessions, RULE.model_copy(update={"consecutive": 1}))
    add_receiver(sessions, "ops", receiver.url, [new_secret()])
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
    delivered = [headers["webhook-id"] for headers, _ in receiver.requests[3:]]
    assert len(delivered) == 20
    assert len(set(delivered)) == 20
    with sessions() as session:
        rows = session.scalars(select(DeliveryRow)).all()
        assert {row.status for row in rows} == {"delivered"}
        assert {row.webhook_id for row in rows} == set(delivered)
        assert max(row.attempts for row in rows) >= 2
        # firing strictly before resolved for every episode
        order = {json.loads(body)["quantwatch"]["episode_id"]: [] for _, body in requests}
        for _, body in receiver.requests[3:]:
            payload = json.loads(body)
            order[payload["quantwatch"]["episode_id"]].append(payload["status"])
        assert all(statuses == ["firing", "resolved"] for statuses in order.values())


def test_gone_disables_receiver_and_retry_after_is_honoured(engine: Engine) -> None:
    sessions = sessionmaker(engine)
    gone, slow = Receiver().start(), Receiver().start()
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
