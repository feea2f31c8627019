"""Every alert notification of a layer with what-if statistics carries their ``remediation``; without them none."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from tests.service.test_whatif import doc


def test_alerts_carry_the_remediation_of_their_layer(
    make_app: Callable[..., Any], receivers: Callable[..., Any]
) -> None:
    hook = receivers()
    rule = {"name": "grads", "metric": "grad_rel_l2", "op": ">", "threshold": 0.5, "consecutive": 1}
    with TestClient(make_app()) as client:
        assert client.post("/api/v1/receivers", json={"name": "hook", "url": hook.url}).status_code == 201
        assert client.post("/api/v1/rules", json={**rule, "layers": "blocks.*"}).status_code == 201
        assert client.post("/api/v1/ingest", json=doc("rem", [10, 11], rel=0.9)).status_code == 200
        firing = client.get("/api/v1/alerts", params={"state": "firing", "run": "rem"}).json()
        text = {a["layer"]: a["annotations"].get("remediation") for a in firing}
        assert text["blocks.1.fc2"] == (
            "blocks.1.fc2: its gradients lose 54% of their values to underflow as FP4 E2M1 with one scale per "
            "tensor; NVFP4 blocks would lose 9%, FP8 E4M3 with one scale per tensor 0.1%. Advice (weight <= 0.05, "
            "input <= 0.05, grad <= 0.05, last 5 what-if steps): weight mxfp8, input high precision, grad "
            "fp8_e4m3:tensor."
        )
        assert text["blocks.0.fc1"].startswith(
            "blocks.0.fc1: its inputs have a relative error of 0.03 as FP8 E4M3 with one scale per tensor; "
        )
        body = json.loads(hook.wait_for(1)[0][1])
        assert body["alerts"]
        assert all(a["annotations"]["remediation"] == text[a["labels"]["layer"]] for a in body["alerts"])
        # Without what-if statistics there is no remediation at all.
        no_whatif = doc("plain", [1, 2], rel=0.9)
        assert client.post("/api/v1/ingest", json=no_whatif).status_code == 200
        plain = client.get("/api/v1/alerts", params={"state": "firing", "run": "plain"}).json()
        assert plain
        assert all("remediation" not in a["annotations"] for a in plain)
