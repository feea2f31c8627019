"""The ingest answer's firing episodes, kept per process behind the run's firing token (issue 21): a change made by
another replica, or by the rule routes, reaches this replica's next answer; an unchanged list is not read again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from alembic import command
from quantwatch.protocol import FIRING_EPISODES_FIELD
from quantwatch.service.alerts import firing
from quantwatch.service.server import BackgroundServer
from tests.service.conftest import HoldingObserver, batch_doc, encode

RULE = "quantwatch_update_direction"  # update_cosine below 0.95 for 3 steps; keeps firing 4 clear steps


@pytest.fixture
def replicas(make_app: Callable[..., Any]) -> Iterator[tuple[TestClient, TestClient]]:
    """Two collectors on one database, as two replicas are."""
    with ExitStack() as stack:
        first, second = (stack.enter_context(TestClient(make_app())) for _ in range(2))
        yield first, second


@pytest.fixture
def list_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The runs whose firing list was read from the database, in order."""
    reads: list[str] = []
    read = firing.firing_episodes

    def counted(session: Any, run: str) -> list[dict[str, Any]]:
        reads.append(run)
        return read(session, run)

    monkeypatch.setattr(firing, "firing_episodes", counted)
    return reads


def _post(client: TestClient, rank: int, steps: range, cosines: tuple[float, float]) -> list[tuple[str, list[int]]]:
    """Post update cosines of layers (a, b) on ``rank``; the answer's firing (layer, ranks)."""
    doc = batch_doc("loop", ["a", "b"], list(steps), {"update_cosine": np.array([cosines] * len(steps))}, rank=rank)
    body, headers = encode(doc, "msgpack")
    response = client.post("/api/v1/ingest", content=body, headers=headers)
    assert response.status_code == 200, response.text
    return [(episode["layer"], episode["ranks"]) for episode in response.json().get(FIRING_EPISODES_FIELD, [])]


def test_another_replicas_episodes_reach_this_replicas_next_answer(
    replicas: tuple[TestClient, TestClient], list_reads: list[str]
) -> None:
    first, second = replicas
    assert _post(first, 0, range(6), (1.0, 0.5)) == [("b", [0])]
    reads = len(list_reads)
    assert _post(first, 0, range(6, 8), (1.0, 0.5)) == [("b", [0])]  # nothing moved: the kept list
    assert len(list_reads) == reads
    # The other replica makes layer a fire on rank 1 and rank 1 join b: this replica's batch moves nothing of its own.
    assert _post(second, 1, range(6), (0.5, 0.5)) == [("b", [0, 1]), ("a", [1])]
    assert _post(first, 0, range(8, 10), (1.0, 0.5)) == [("b", [0, 1]), ("a", [1])]
    # Rank 1 recovers on the other replica: a resolves there (b still fires on rank 0), and here too.
    assert _post(second, 1, range(6, 16), (1.0, 1.0)) == [("b", [0, 1])]
    assert _post(first, 0, range(10, 12), (1.0, 0.5)) == [("b", [0, 1])]


def test_a_rule_deleted_on_another_replica_leaves_this_replicas_next_answer(
    replicas: tuple[TestClient, TestClient],
) -> None:
    first, second = replicas
    assert _post(first, 0, range(6), (0.5, 0.5)) == [("a", [0]), ("b", [0])]
    assert _post(first, 0, range(6, 8), (0.5, 0.5)) == [("a", [0]), ("b", [0])]
    assert second.delete(f"/api/v1/rules/{RULE}").status_code == 204  # its firing episodes resolve
    assert _post(first, 0, range(8, 10), (0.5, 0.5)) == []


def test_migration_0013_round_trip_keeps_the_answers_firing_episodes(empty_database_url: str) -> None:
    """Down to 0011 (the tokens dropped) and up again with episodes firing: a collector started on it lists them, and
    follows their changes from there (the upgrade writes no tokens: a run without any is read once, then kept)."""
    from quantwatch.service import Settings, create_app
    from quantwatch.service.core.db import alembic_config, make_engine, upgrade

    engine = make_engine(Settings(database_url=empty_database_url))
    cfg = alembic_config(empty_database_url)
    try:
        app = create_app(Settings(database_url=empty_database_url))
        with TestClient(app) as client:
            assert _post(client, 0, range(6), (1.0, 0.5)) == [("b", [0])]
        app.state.engine.dispose()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0011_alert_state_columns")
        assert "alert_firing_tokens" not in inspect(engine).get_table_names()
        upgrade(engine)
        app = create_app(Settings(database_url=empty_database_url))
        with TestClient(app) as client:
            assert _post(client, 0, range(6, 8), (1.0, 0.5)) == [("b", [0])]
            assert _post(client, 1, range(6), (0.5, 1.0)) == [("b", [0]), ("a", [1])]
            assert _post(client, 0, range(8, 20), (1.0, 1.0)) == [("a", [1])]
        app.state.engine.dispose()
    finally:
        engine.dispose()


def test_batches_stored_in_one_group_each_answer_with_their_own_runs_firing_episodes(
    make_app: Callable[..., Any],
) -> None:
    """Batches of different runs that share one transaction (SQLite's group commit; side by side on PostgreSQL) each
    answer with their own run's firing episodes, which the alert engine keeps with the batch, not the thread."""
    app = make_app()
    holding = HoldingObserver("held")
    app.state.ingest_observers.append(holding)

    def post(http: httpx.Client, run: str, steps: range, cosine: float, batch_id: str | None = None) -> list[str]:
        layers = [f"{run}.a", f"{run}.b"]  # the answer names layers, not runs
        doc = batch_doc(run, layers, list(steps), {"update_cosine": np.full((len(steps), 2), cosine)})
        if batch_id is not None:
            doc["batch_id"] = batch_id
        body, headers = encode(doc, "msgpack")
        response = http.post("/api/v1/ingest", content=body, headers=headers)
        assert response.status_code == 200, response.text
        return [episode["layer"] for episode in response.json().get(FIRING_EPISODES_FIELD, [])]

    with BackgroundServer(app) as server, ThreadPoolExecutor(3) as pool:
        clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(3)]
        assert post(clients[0], "hot", range(6), 0.5) == ["hot.a", "hot.b"]
        assert post(clients[0], "cool", range(6), 1.0) == []
        held = pool.submit(post, clients[0], "hold", range(1), 1.0, "held")
        assert holding.entered.wait(30)
        hot = pool.submit(post, clients[1], "hot", range(6, 8), 0.5)
        cool = pool.submit(post, clients[2], "cool", range(6, 8), 1.0)
        group = app.state.store._writer._group
        if group is not None:  # SQLite: both queue to join the held batch's group
            deadline = time.monotonic() + 30
            while group._waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert group._waiting == 2
        holding.release.set()
        assert (held.result(), hot.result(), cool.result()) == ([], ["hot.a", "hot.b"], [])
        for client in clients:
            client.close()
