"""``GET /api/v1/runs/{run}/steps/{step}``: one metric at one step, layers × ranks, from points ingested through the
real ingest path (both backends)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.service.conftest import batch_doc, encode

LAYERS = ["embed", "blocks.0.fc", "blocks.1.fc"]


def _value(rank: int, step: int, layer: int) -> float:
    """The float32 sent, as the JSON answer spells it (its shortest float32 text)."""
    return float(np.format_float_positional(np.float32(0.001 * (1 + layer) + 0.01 * rank + 0.0001 * step)))


def _ingest(client: Any) -> None:
    """Ranks 0 and 1 every 10 steps from 0 to 30; rank 2 only at steps 0 and 30; rank 1 misses one layer at 20."""
    for rank, steps in ((0, [0, 10, 20, 30]), (1, [0, 10, 20, 30]), (2, [0, 30])):
        values = np.array([[_value(rank, s, i) for i in range(len(LAYERS))] for s in steps], dtype=np.float32)
        if rank == 1:
            values[steps.index(20), 1] = np.nan  # null on the wire: not measured
        doc = batch_doc("dp", LAYERS, steps, {"output_rel_l2": values}, rank=rank)
        body, headers = encode(doc, "msgpack" if rank else "json")
        assert client.post("/api/v1/ingest", content=body, headers=headers).status_code == 200


def test_layers_by_ranks_at_a_step_with_a_rank_that_did_not_report(client: Any) -> None:
    _ingest(client)
    answer = client.get("/api/v1/runs/dp/steps/10", params={"metric": "output_rel_l2"}).json()
    assert answer["step"] == 10
    assert answer["metric"] == "output_rel_l2"
    assert answer["layers"] == LAYERS
    assert answer["ranks"] == [0, 1, 2]
    want = [[_value(0, 10, i), _value(1, 10, i), None] for i in range(len(LAYERS))]
    assert answer["values"] == want

    at_20 = client.get("/api/v1/runs/dp/steps/20", params={"metric": "output_rel_l2"}).json()
    assert at_20["values"][1] == [_value(0, 20, 1), None, None]
    assert at_20["values"][2] == [_value(0, 20, 2), _value(1, 20, 2), None]

    every = client.get("/api/v1/runs/dp/steps/30", params={"metric": "output_rel_l2"}).json()
    assert every["values"][0] == [_value(r, 30, 0) for r in range(3)]


def test_a_step_nobody_measured_answers_the_next_measured_one_or_none(client: Any) -> None:
    _ingest(client)
    answer = client.get("/api/v1/runs/dp/steps/11", params={"metric": "output_rel_l2"}).json()
    assert answer["step"] == 20
    assert answer["values"][0] == [_value(0, 20, 0), _value(1, 20, 0), None]
    past = client.get("/api/v1/runs/dp/steps/31", params={"metric": "output_rel_l2"}).json()
    assert past["step"] is None
    assert past["ranks"] == [0, 1, 2]
    assert past["values"] == [[None, None, None]] * len(LAYERS)


def test_a_layer_added_later_is_not_measured_at_earlier_steps(client: Any) -> None:
    _ingest(client)
    later = batch_doc("dp", [*LAYERS, "head"], [40], {"output_rel_l2": np.array([[0.5, 0.5, 0.5, 0.25]])}, rank=2)
    body, headers = encode(later)
    assert client.post("/api/v1/ingest", content=body, headers=headers).status_code == 200
    early = client.get("/api/v1/runs/dp/steps/10", params={"metric": "output_rel_l2"}).json()
    assert early["layers"] == [*LAYERS, "head"]
    assert early["values"][3] == [None, None, None]
    assert early["values"][0] == [_value(0, 10, 0), _value(1, 10, 0), None]
    assert client.get("/api/v1/runs/dp/steps/40", params={"metric": "output_rel_l2"}).json()["values"][3] == [
        None,
        None,
        0.25,
    ]


def test_bad_input_is_a_problem(client: Any) -> None:
    _ingest(client)
    for path, params, status, field in (
        ("/api/v1/runs/dp/steps/-1", {"metric": "output_rel_l2"}, 422, "path.step"),
        ("/api/v1/runs/dp/steps/ten", {"metric": "output_rel_l2"}, 422, "path.step"),
        ("/api/v1/runs/dp/steps/10", {}, 422, "query.metric"),
        ("/api/v1/runs/dp/steps/10", {"metric": "no_such_metric"}, 404, None),
        ("/api/v1/runs/nope/steps/10", {"metric": "output_rel_l2"}, 404, None),
    ):
        response = client.get(path, params=params)
        assert response.status_code == status, path
        assert response.headers["content-type"] == "application/problem+json"
        problem = response.json()
        if field is not None:
            assert field in [e["field"] for e in problem["errors"]], problem
        else:
            assert "not found" in problem["detail"], problem
