"""Payloads recorded from earlier agents stay accepted as the wire grows (tests/service/data/payloads/*/)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

PAYLOADS = Path(__file__).parent / "data" / "payloads"
RECORDED = [
    (generation.name, entry)
    for generation in sorted(p for p in PAYLOADS.iterdir() if p.is_dir())
    for entry in json.loads((generation / "manifest.json").read_text())
]


@pytest.mark.parametrize(("generation", "entry"), RECORDED, ids=[f"{g}/{e['file']}" for g, e in RECORDED])
def test_recorded_payload_is_stored_once_with_every_point(client: Any, generation: str, entry: dict[str, Any]) -> None:
    body = (PAYLOADS / generation / entry["file"]).read_bytes()
    headers = {"Content-Type": entry["content_type"]} | ({"Content-Encoding": "gzip"} if entry["gzip"] else {})
    first = client.post("/api/v1/ingest", content=body, headers=headers)
    assert first.status_code == 200, first.text
    assert first.json()["points"] == entry["points"]
    assert first.json()["duplicate"] is False
    again = client.post("/api/v1/ingest", content=body, headers=headers).json()
    assert again["duplicate"] is True
    run = client.get("/api/v1/runs").json()
    assert [r["name"] for r in run] == [entry["run"]]
    assert run[0]["ranks"] == [entry["rank"]]
    assert (run[0]["first_step"], run[0]["last_step"]) == (entry["steps"][0], entry["steps"][-1])
    layers = [x["name"] for x in client.get(f"/api/v1/runs/{entry['run']}/layers").json()]
    assert layers == entry["layers"]
    if "output_rel_l2" in run[0]["metrics"]:
        series = client.get(
            f"/api/v1/runs/{entry['run']}/series",
            params={"metric": "output_rel_l2", "layer": entry["layers"][0], "rank": entry["rank"]},
        ).json()
        assert series["steps"]
        assert all(isinstance(v, float) and math.isfinite(v) for v in series["mean"])
