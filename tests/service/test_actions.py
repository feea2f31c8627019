"""The closed loop on the collector's side: the ingest answer names the run's firing episodes (and nothing when none
fires), batches carry the agent's actions, stored once in ``run_actions`` (migration 0009) and listed by
``GET /api/v1/actions?run=``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import inspect

from alembic import command
from quantwatch.protocol import FIRING_EPISODE_KEYS, FIRING_EPISODES_FIELD
from quantwatch.service.core.config import Settings
from quantwatch.service.core.db import alembic_config, make_engine, upgrade
from tests.service.conftest import batch_doc

KEEP = {"step": 5, "action": "keep_high_precision", "layer": "b", "detail": "weight fp4 → fp8", "episode": 1}


def _cosines(
    post_batch: Callable[..., Any], steps: range, value: float, actions: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    doc = batch_doc("loop", ["a", "b"], list(steps), {"update_cosine": np.array([[1.0, value]] * len(steps))})
    if actions is not None:
        doc["actions"] = actions
    response = post_batch(doc, "msgpack")
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_the_ingest_answer_names_the_firing_episodes_only_while_they_fire(post_batch: Callable[..., Any]) -> None:
    quiet = _cosines(post_batch, range(3), 1.0)
    assert FIRING_EPISODES_FIELD not in quiet  # nothing fires: the answer is as it always was
    assert FIRING_EPISODES_FIELD not in _cosines(post_batch, range(3, 5), 0.5)  # pending: 2 of 3 steps
    fired = _cosines(post_batch, range(5, 6), 0.5)
    [episode] = fired[FIRING_EPISODES_FIELD]
    assert list(episode) == list(FIRING_EPISODE_KEYS)
    assert {k: episode[k] for k in ("rule", "layer", "ranks", "since_step", "severity")} == {
        "rule": "quantwatch_update_direction",
        "layer": "b",
        "ranks": [0],
        "since_step": 5,
        "severity": "warning",
    }
    # Still firing while it recovers (keep_firing_for), then resolved: gone from the answer.
    assert _cosines(post_batch, range(6, 10), 1.0)[FIRING_EPISODES_FIELD] == [episode]
    assert FIRING_EPISODES_FIELD not in _cosines(post_batch, range(10, 20), 1.0)


def test_actions_are_stored_once_and_listed_by_step(post_batch: Callable[..., Any], client: Any) -> None:
    stop = {"step": 9, "action": "stop_training"}
    _cosines(post_batch, range(6), 1.0, [KEEP])
    _cosines(post_batch, range(6, 10), 1.0, [KEEP, stop])  # the first again (a re-sent batch): kept once
    listed = client.get("/api/v1/actions", params={"run": "loop"}).json()
    assert [{k: a[k] for k in ("step", "rank", "action", "layer", "detail", "episode")} for a in listed] == [
        {**KEEP, "rank": 0},
        {"step": 9, "rank": 0, "action": "stop_training", "layer": "", "detail": "", "episode": None},
    ]
    assert client.get("/api/v1/actions", params={"run": "nope"}).status_code == 404
    # A query parameter, not a path under the run: a run whose name ends in /actions keeps its detail route.
    post_batch(batch_doc("x/actions", ["a"], [0], {"m": np.ones((1, 1))}), "json")
    assert client.get("/api/v1/runs/x/actions").json()["name"] == "x/actions"
    bad = batch_doc("loop", ["a"], [30], {"update_cosine": np.ones((1, 1))})
    bad["actions"] = [{"step": 3, "action": "reboot"}]
    refused = post_batch(bad, "json")
    assert refused.status_code == 422
    assert "actions[0].action" in refused.text


def test_migration_0009_upgrades_a_database_holding_data(empty_database_url: str) -> None:
    from fastapi.testclient import TestClient

    from quantwatch.service import create_app
    from tests.service.conftest import encode

    def post(client: Any, doc: dict[str, Any]) -> None:
        body, headers = encode(doc, "json", False)
        assert client.post("/api/v1/ingest", content=body, headers=headers).status_code == 200

    engine = make_engine(Settings(database_url=empty_database_url))
    cfg = alembic_config(empty_database_url)
    try:
        app = create_app(Settings(database_url=empty_database_url))
        with TestClient(app) as client:  # data stored, then the schema taken back to 0009 under it
            post(client, batch_doc("old", ["a"], [0, 1], {"m": np.ones((2, 1))}))
        app.state.engine.dispose()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0009_alert_series_states")
        assert "run_actions" not in inspect(engine).get_table_names()
        upgrade(engine)  # 0010 on top of that data
        assert "run_actions" in inspect(engine).get_table_names()
        app = create_app(Settings(database_url=empty_database_url))
        with TestClient(app) as client:
            doc = batch_doc("old", ["a"], [2], {"m": np.ones((1, 1))})
            doc["actions"] = [KEEP]
            post(client, doc)
            series = client.get("/api/v1/runs/old/series", params={"metric": "m", "layer": "a"}).json()
            assert series["steps"] == [0, 1, 2]
            assert [a["action"] for a in client.get("/api/v1/actions", params={"run": "old"}).json()] == [
                "keep_high_precision"
            ]
        app.state.engine.dispose()
    finally:
        engine.dispose()
