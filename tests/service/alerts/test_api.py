"""The alerting REST API on a real collector app: rules, receivers, alerts, deliveries; errors as problem+json."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from fastapi.testclient import TestClient

PROBLEM = "https://quantwatch.dev/problems/"
RULE = {
    "name": "attn_drift",
    "metric": "output_rel_l2",
    "layers": "attn.*",
    "op": ">",
    "threshold": 0.05,
    "consecutive": 2,
}


def batch(run: str, steps: range, value: float, rank: int = 0) -> dict[str, Any]:
    return {
        "run": run,
        "rank": rank,
        "batch_id": f"{run}-{rank}-{steps.start}-{time.monotonic_ns()}",
        "layers": ["attn.q", "mlp.fc1"],
        "steps": [{"step": s, "time": 1.7e9 + s, "metrics": {"output_rel_l2": [value, 0.0]}} for s in steps],
    }


def test_rules_crud_and_validation(make_app: Callable[..., Any]) -> None:
    with TestClient(make_app()) as client:
        names = {rule["name"]: rule for rule in client.get("/api/v1/rules").json()}
        assert {"quantwatch_output_deviation", "quantwatch_nonfinite", "quantwatch_loss_divergence"} <= set(names)
        assert names["quantwatch_nonfinite"]["source"] == "default"

        created = client.post("/api/v1/rules", json=RULE)
        assert created.status_code == 201, created.text
        assert created.json()["keep_firing_for"] == 0
        assert client.post("/api/v1/rules", json=RULE).status_code == 409

        for change, field in [
            ({"consecutive": -1}, "body.consecutive"),
            ({"metric": "bogus"}, "body.metric"),
            ({"op": "=="}, "body.op"),
            ({"layers": "a[b"}, "body.layers"),
            ({"annotations": {"summary": "${evil.__class__}"}}, "body.annotations"),
            ({"receivers": ["nobody"]}, "body.receivers.0"),
        ]:
            answer = client.post("/api/v1/rules", json={**RULE, "name": "other", **change})
            assert answer.status_code == 422, (change, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"] == PROBLEM + "validation-error"
            assert any(error["field"] == field for error in answer.json()["errors"]), answer.json()

        replaced = client.put("/api/v1/rules/attn_drift", json={**RULE, "threshold": 0.1})
        assert replaced.json()["threshold"] == 0.1
        assert replaced.json()["revision"] == 2
        assert client.put("/api/v1/rules/attn_drift", json={**RULE, "name": "x"}).status_code == 422
        assert client.put("/api/v1/rules/nope", json={**RULE, "name": "nope"}).status_code == 404

        assert client.delete("/api/v1/rules/quantwatch_nonfinite").status_code == 204
        assert client.get("/api/v1/rules/quantwatch_nonfinite").json()["enabled"] is False
        assert client.delete("/api/v1/rules/attn_drift").status_code == 204
        assert client.get("/api/v1/rules/attn_drift").status_code == 404


def test_nul_characters_in_bodies_are_refused_not_crashed(make_app: Callable[..., Any]) -> None:
    # PostgreSQL text cannot hold NUL: found by schemathesis as a 500; every such body must be a 422 naming the field.
    with TestClient(make_app()) as client:
        webhook = {"name": "hook", "type": "webhook", "url": "http://127.0.0.1:9/hook"}
        for path, body, field in [
            ("/api/v1/rules", {**RULE, "annotations": {"summary": "a\x00b"}}, "body.annotations.summary"),
            ("/api/v1/rules", {**RULE, "labels": {"te\x00am": "x"}}, "body.labels.te\x00am"),
            ("/api/v1/receivers", {**webhook, "url": "http://127.0.0.1:9/\x00"}, "body.url"),
            ("/api/v1/receivers", {**webhook, "headers": {"X-A": "b\x00"}}, "body.headers.X-A"),
            ("/api/v1/receivers", {**webhook, "secrets": ["whsec_\x00"]}, "body.secrets[0]"),
        ]:
            answer = client.post(path, json=body)
            assert answer.status_code == 422, (body, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["errors"][0]["field"] == field
        assert "attn_drift" not in {rule["name"] for rule in client.get("/api/v1/rules").json()}
        assert client.get("/api/v1/receivers").json() == []


def test_writes_need_admin(make_app: Callable[..., Any]) -> None:
    app = make_app(tokens={"reader": ["read"], "boss": ["admin"]})
    with TestClient(app) as client:
        assert client.post("/api/v1/rules", json=RULE).status_code == 401
        forbidden = client.post("/api/v1/rules", json=RULE, headers={"Authorization": "Bearer reader"})
        assert forbidden.status_code == 403
        assert forbidden.json()["type"] == PROBLEM + "forbidden"
        assert client.get("/api/v1/rules", headers={"Authorization": "Bearer reader"}).status_code == 200
        assert client.post("/api/v1/rules", json=RULE, headers={"Authorization": "Bearer boss"}).status_code == 201


def test_receivers_keep_secrets_write_only(make_app: Callable[..., Any], whsec: Callable[[], str]) -> None:
    secret = whsec()
    with TestClient(make_app()) as client:
        body = {
            "name": "ops",
            "url": "http://127.0.0.1:9/hook",
            "secret": secret,
            "headers": {"Authorization": "Bearer topsecret"},
        }
        created = client.post("/api/v1/receivers", json=body)
        assert created.status_code == 201, created.text
        listing = client.get("/api/v1/receivers")
        for text in (created.text, listing.text, client.get("/api/v1/receivers/ops").text):
            assert secret not in text
            assert "topsecret" not in text
        assert listing.json()[0]["secret_count"] == 1
        assert listing.json()[0]["header_names"] == ["Authorization"]
        bad = client.post("/api/v1/receivers", json={**body, "name": "x", "url": "ftp://h/"})
        assert bad.status_code == 422
        assert bad.json()["errors"][0]["field"] == "body.url"
        weak = client.post("/api/v1/receivers", json={**body, "name": "y", "secret": "whsec_c2hvcnQ="})
        assert weak.status_code == 422
        assert "whsec_c2hvcnQ=" not in weak.text
        assert client.delete("/api/v1/receivers/ops").status_code == 204
        assert client.get("/api/v1/receivers").json() == []


def _live(alerts: Any) -> dict[tuple[str, int, str, str], tuple[str, int]]:
    """The engine's in-memory series (what /metrics reads) by (run, rank, rule, layer): (status, streak)."""
    return {
        (run, rank, rule, layer): (state.status.value, state.streak)
        for run, rank, _, states in alerts.latest_states()
        for (rule, layer), state in states.items()
    }


def test_states_of_ranks_idle_past_the_ttl_leave_memory_and_come_back_from_the_database(
    make_app: Callable[..., Any],
) -> None:
    with TestClient(make_app(metrics_run_ttl_seconds=0.5)) as client:
        assert client.post("/api/v1/rules", json=RULE).status_code == 201
        assert client.post("/api/v1/ingest", json=batch("gpt", range(1, 3), 0.5, rank=1)).status_code == 200
        alerts = client.app.state.alerts
        assert _live(alerts)[("gpt", 1, "attn_drift", "attn.q")] == ("firing", 2)
        time.sleep(0.6)
        assert client.post("/api/v1/ingest", json=batch("other", range(1, 2), 0.0)).status_code == 200
        assert {(run, rank) for run, rank, *_ in _live(alerts)} == {("other", 0)}  # gpt's rank 1: idle past the TTL
        # Its next batch goes on from the states stored: the streaks count on (the shipped rule, pending for 2
        # steps, fires at its third), the firing episode stays the one of step 2.
        assert client.post("/api/v1/ingest", json=batch("gpt", range(3, 4), 0.5, rank=1)).status_code == 200
        assert _live(alerts)[("gpt", 1, "attn_drift", "attn.q")] == ("firing", 3)
        firing = client.get("/api/v1/alerts", params={"state": "firing", "run": "gpt"}).json()
        assert sorted((a["rule"], a["layer"], a["firing"]["step"]) for a in firing) == [
            ("attn_drift", "attn.q", 2),
            ("quantwatch_output_deviation", "attn.q", 3),
        ]


def test_ingest_fires_lists_and_redelivers(make_app: Callable[..., Any], receivers: Callable[..., Any]) -> None:
    hook = receivers()
    with TestClient(make_app()) as client:
        assert client.post("/api/v1/receivers", json={"name": "hook", "url": hook.url}).status_code == 201
        assert client.post("/api/v1/rules", json=RULE).status_code == 201
        assert client.post("/api/v1/ingest", json=batch("gpt", range(1, 3), 0.5)).status_code == 200
        firing = client.get("/api/v1/alerts", params={"state": "firing", "run": "gpt"}).json()
        assert [(a["rule"], a["layer"], a["firing"]["step"]) for a in firing] == [("attn_drift", "attn.q", 2)]
        assert client.get("/api/v1/alerts", params={"run": "other"}).json() == []
        alerts = client.app.state.alerts  # the read methods the Prometheus exposition calls
        latest = _live(alerts)
        assert latest[("gpt", 0, "attn_drift", "attn.q")] == ("firing", 2)
        assert latest[("gpt", 0, "quantwatch_output_deviation", "attn.q")] == ("pending", 2)
        assert latest[("gpt", 0, "quantwatch_output_deviation", "mlp.fc1")] == ("inactive", 0)
        with client.app.state.store.factory() as session:
            stored = alerts.series_snapshot(session, ["gpt"])
        assert sorted((s.rule, s.layer, s.series, s.status, s.streak, s.last_step) for s in stored) == [
            ("attn_drift", "attn.q", "output_rel_l2", "firing", 2, 2),
            ("quantwatch_output_deviation", "attn.q", "output_rel_l2", "pending", 2, 2),
            ("quantwatch_output_deviation", "mlp.fc1", "output_rel_l2", "inactive", 0, 2),
        ]
        hook.wait_for(1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            log = client.get("/api/v1/deliveries", params={"receiver": "hook"}).json()
            if log and log[0]["status"] == "delivered":
                break
            time.sleep(0.05)
        assert [(d["event"], d["status"]) for d in log] == [("firing", "delivered")]
        replay = client.post(f"/api/v1/deliveries/{log[0]['id']}/redeliver")
        assert replay.status_code == 202
        requests = hook.wait_for(2)
        assert len(requests) == 2
        link = urlsplit(json.loads(requests[0][1])["quantwatch"]["history_url"])
        history = client.get(f"{link.path}?{link.query}")
        assert history.status_code == 200, history.text
        assert history.json()["steps"] == [1, 2]
        assert history.json()["max"] == [0.5, 0.5]
        assert requests[0][0]["webhook-id"] == requests[1][0]["webhook-id"] == log[0]["webhook_id"]
        assert client.post("/api/v1/deliveries/999999/redeliver").status_code == 404
        assert client.get("/api/v1/alerts", params={"state": "bogus"}).status_code == 422
