"""A batch's alert reads in one statement (issue 21): a batch whose rules advance but move no episode runs two
alert statements (the head and the upsert of its states), and what the head read stays current across replicas and
rule changes."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from sqlalchemy import event

from quantwatch.protocol import FIRING_EPISODES_FIELD
from tests.service.conftest import batch_doc, encode

LAYERS = ["a", "b", "c"]
_ALERT_TABLES = re.compile(r"\b(alert_\w+|layer_formats)\b")


def _post(client: TestClient, rank: int, step: int, cosine: float) -> list[str]:
    """Post one step of update cosines on ``rank``; the answer's firing layers."""
    values = {"update_cosine": np.full((1, len(LAYERS)), cosine, dtype=np.float32)}
    body, headers = encode(batch_doc("head", LAYERS, [step], values, rank=rank), "msgpack")
    response = client.post("/api/v1/ingest", content=body, headers=headers)
    assert response.status_code == 200, response.text
    return [episode["layer"] for episode in response.json().get(FIRING_EPISODES_FIELD, [])]


def test_a_quiet_batch_runs_two_alert_statements(make_app: Callable[..., Any]) -> None:
    app = make_app()
    recorded: list[tuple[int, str]] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if _ALERT_TABLES.search(statement):
            recorded.append((threading.get_ident(), statement))

    with TestClient(app) as client:
        _post(client, 0, 0, 1.0)
        event.listen(app.state.store.engine, "after_cursor_execute", record)
        assert _post(client, 0, 1, 1.0) == []
    # The batch's own statements: those of the thread that stored it. The app's background threads read alert tables
    # at times of their own; a full suite run on PostgreSQL once recorded four statements here (two heads, one with no
    # rule), not reproduced alone or under load, and thought to be theirs.
    batch_thread = next(thread for thread, statement in recorded if "INSERT INTO" in statement.upper())
    statements = [statement for thread, statement in recorded if thread == batch_thread]
    assert len(statements) == 2
    head, upsert = (statement.lstrip().upper() for statement in statements)
    assert head.startswith("SELECT")
    assert "UNION ALL" in head
    assert upsert.startswith("INSERT INTO ALERT_SERIES_STATES")


def test_the_head_sees_other_replicas_and_the_batchs_own_changes(make_app: Callable[..., Any]) -> None:
    """The firing list follows an episode this batch fired (its own token redrawn after the head was read), one that
    another replica resolved, and a rule disabled through the API on the other replica."""
    with TestClient(make_app()) as first, TestClient(make_app()) as second:
        for step in range(2):
            assert _post(first, 0, step, 0.5) == []
        assert _post(first, 0, 2, 0.5) == LAYERS  # the third breach fires in this very batch
        for step in range(3, 13):  # keep_firing_for 9: the tenth clear step resolves
            answer = _post(second, 0, step, 1.0)
        assert answer == []
        assert _post(first, 0, 13, 1.0) == []
        for step in range(14, 17):
            answer = _post(first, 0, step, 0.5)
        assert answer == LAYERS
        disabled = second.delete("/api/v1/rules/quantwatch_update_direction")  # a shipped rule: disabled
        assert disabled.status_code == 204, disabled.text
        assert _post(first, 0, 17, 0.5) == []
