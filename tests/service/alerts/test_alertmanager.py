"""A real Alertmanager receives pushed alerts and routes them to a webhook on loopback."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import StepInput
from quantwatch.service.alerts.outbox import DeliveryWorker
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.tables import DeliveryRow, ReceiverRow, RuleRow
from quantwatch.service.core.db import write_session


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_alertmanager_routes_pushed_alerts(engine: Engine, alertmanager: tuple[str, Any]) -> None:
    base, hook = alertmanager
    sessions = sessionmaker(engine)
    rule = Rule(
        name="fp4_nonfinite", metric="nonfinite_count", op=">", threshold=0, consecutive=1, labels={"team": "numerics"}
    )
    with sessions.begin() as session:
        session.add(RuleRow(name=rule.name, source="api", definition=rule.model_dump(mode="json"), updated_at=0.0))
        session.add(
            ReceiverRow(name="am", source="api", type="alertmanager", url=base, secrets=[], headers={}, updated_at=0.0)
        )
    alerts = AlertEngine(external_url="http://127.0.0.1:8000", delivery_horizon_seconds=600)
    worker = DeliveryWorker(sessions)
    try:
        with write_session(sessions) as session:
            alerts.evaluate(
                session, "gpt-fp4", 2, ["blocks.0.mlp.fc1"], [StepInput(40, 1.7e9, {"nonfinite_count": [3.0]}, {})]
            )
        assert worker.run_once() == 1
        firing = json.loads(hook.wait_for(1)[0][1])
        with write_session(sessions) as session:
            alerts.evaluate(
                session, "gpt-fp4", 2, ["blocks.0.mlp.fc1"], [StepInput(41, 1.7e9 + 1, {"nonfinite_count": [0.0]}, {})]
            )
        assert worker.run_once() == 1
        resolved = json.loads(hook.wait_for(2)[1][1])
        with sessions() as session:
            assert {row.status for row in session.scalars(select(DeliveryRow))} == {"delivered"}
    finally:
        worker.stop()
    assert firing["status"] == "firing"
    labels = firing["alerts"][0]["labels"]
    assert labels == {
        "alertname": "fp4_nonfinite",
        "run": "gpt-fp4",
        "layer": "blocks.0.mlp.fc1",
        "metric": "nonfinite_count",
        "severity": "warning",
        "team": "numerics",
    }
    assert firing["groupLabels"] == {"alertname": "fp4_nonfinite", "run": "gpt-fp4", "layer": "blocks.0.mlp.fc1"}
    assert "step 40" in firing["alerts"][0]["annotations"]["description"]
    assert resolved["status"] == "resolved"
    assert resolved["alerts"][0]["endsAt"].startswith("2023-11-14T22:13:21")
