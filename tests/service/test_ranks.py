"""Cross-rank checks in the collector: fingerprints compared per replica group and step, the shipped rule's episode,
incomplete groups, the environment check, and bad rank fields (both backends)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from quantwatch.service.ranks.compare import MISMATCH_FLOOR, compare_layer, mismatch
from tests.service.conftest import batch_doc, encode

LAYERS = ["blocks.0.fc", "blocks.1.fc"]
SAME = ("00000000000000aa00000000000000bb", 1.5, 4.0)
OTHER = ("00000000000000cc00000000000000dd", 1.5, 4.41)


def _doc(rank: int, step: int, prints: Sequence[tuple[str, float, float] | None], group: Sequence[int], **extra: Any):
    doc = batch_doc("ddp", LAYERS, [step], {}, rank=rank)
    doc["steps"][0]["fingerprints"] = {
        "group": list(group),
        "hash": [p[0] if p else None for p in prints],
        "sum": [p[1] if p else None for p in prints],
        "sumsq": [p[2] if p else None for p in prints],
    }
    doc["steps"][0].update(extra)
    return doc


def _post(client: Any, doc: dict[str, Any], kind: str = "json") -> Any:
    body, headers = encode(doc, kind)
    return client.post("/api/v1/ingest", content=body, headers=headers)


def _mismatch_episodes(client: Any, run: str = "ddp") -> list[dict[str, Any]]:
    alerts = client.get("/api/v1/alerts", params={"run": run}).json()
    return [a for a in alerts if a["rule"] == "quantwatch_rank_weight_mismatch"]


def test_a_step_is_compared_once_every_rank_reported_and_fires_naming_layer_and_rank(client: Any) -> None:
    for step in (0, 5):
        assert _post(client, _doc(0, step, [SAME, SAME], [0, 1])).status_code == 200
    assert client.get("/api/v1/runs/ddp/ranks").json()["compared_steps"] == 0  # rank 1 has not reported yet
    assert _post(client, _doc(1, 0, [SAME, SAME], [0, 1]), "msgpack").status_code == 200
    assert _mismatch_episodes(client) == []  # identical replicas never fire
    assert _post(client, _doc(1, 5, [SAME, OTHER], [0, 1]), "msgpack").status_code == 200

    answer = client.get("/api/v1/runs/ddp/ranks").json()
    assert answer["compared_steps"] == 2
    assert answer["incomplete_steps"] == 0
    assert answer["mismatched_steps"] == 1
    (found,) = answer["mismatches"]
    assert found["step"] == 5
    assert found["layer"] == "blocks.1.fc"
    assert found["ranks"] == [1]
    assert found["reference_rank"] == 0  # no majority of two: the lowest rank
    assert found["majority"] is False
    assert found["value"] == pytest.approx(0.05)  # |√4.41 − √4| / √4

    (episode,) = _mismatch_episodes(client)
    assert episode["layer"] == "blocks.1.fc"
    assert episode["ranks"] == [1]
    assert episode["state"] == "firing"
    assert episode["firing"]["step"] == 5
    series = client.get(
        "/api/v1/runs/ddp/series", params={"metric": "rank_weight_mismatch", "layer": "blocks.1.fc", "rank": 1}
    ).json()
    assert series["steps"] == [0, 5]
    assert series["mean"][0] == 0.0
    assert series["mean"][1] == pytest.approx(0.05)


def test_a_resent_fingerprint_changes_nothing(client: Any) -> None:
    for rank in (0, 1):
        assert _post(client, _doc(rank, 3, [SAME, OTHER if rank else SAME], [0, 1])).status_code == 200
    assert _post(client, _doc(1, 3, [SAME, OTHER], [0, 1])).status_code == 200  # a retry under a new batch id
    answer = client.get("/api/v1/runs/ddp/ranks").json()
    assert answer["compared_steps"] == 1
    assert len(answer["mismatches"]) == 1
    assert len(_mismatch_episodes(client)) == 1


def test_a_group_still_incomplete_after_the_wait_is_recorded_incomplete_not_mismatched(client: Any) -> None:
    checks = client.app.state.rank_checks
    assert checks.wait_seconds == 60.0  # the default
    start = checks.clock()
    checks.clock = lambda: start
    assert _post(client, _doc(0, 0, [SAME, SAME], [0, 1, 2])).status_code == 200
    assert _post(client, _doc(1, 0, [SAME, OTHER], [0, 1, 2])).status_code == 200
    assert client.get("/api/v1/runs/ddp/ranks").json()["incomplete_steps"] == 0  # still waiting for rank 2
    checks.clock = lambda: start + 61.0
    answer = client.get("/api/v1/runs/ddp/ranks").json()
    assert answer["incomplete_steps"] == 1
    assert answer["incomplete"] == [0]
    assert answer["mismatches"] == []
    assert _mismatch_episodes(client) == []
    # Rank 2 arriving late changes nothing: the step was decided.
    assert _post(client, _doc(2, 0, [SAME, SAME], [0, 1, 2])).status_code == 200
    assert client.get("/api/v1/runs/ddp/ranks").json()["compared_steps"] == 0
    series = client.get(
        "/api/v1/runs/ddp/series", params={"metric": "rank_weight_mismatch", "layer": "blocks.1.fc", "rank": 1}
    )
    assert series.status_code == 404  # not measured


def test_ranks_reporting_different_environments_are_flagged(client: Any) -> None:
    base = {"torch": "2.13.0", "cuda": "", "quantwatch": "0.1.0"}
    for rank, torch_version in ((0, "2.13.0"), (1, "9.9"), (2, "2.13.0")):
        env = base | {"torch": torch_version}
        assert _post(client, _doc(rank, 0, [SAME, SAME], [0, 1, 2], environment=env)).status_code == 200
    answer = client.get("/api/v1/runs/ddp/ranks").json()
    assert [r["rank"] for r in answer["ranks"]] == [0, 1, 2]
    assert answer["environment_consistent"] is False
    assert answer["differing_fields"] == ["torch"]
    assert [r["differs"] for r in answer["ranks"]] == [[], ["torch"], []]
    assert answer["ranks"][1]["environment"]["torch"] == "9.9"
    assert answer["ranks"][0]["group"] == "0-2"


def test_bad_rank_fields_are_refused_naming_the_field(client: Any) -> None:
    doc = _doc(0, 0, [SAME, SAME], [0, 1])
    doc["steps"][0]["fingerprints"]["hash"] = ["zz", None]
    answer = _post(client, doc)
    assert answer.status_code == 422
    assert "steps[0].fingerprints.hash[0]" in answer.text
    doc = _doc(0, 0, [SAME], [0, 1])  # one layer's worth for two layers
    assert "steps[0].fingerprints.hash" in _post(client, doc).text
    assert "must include the batch's rank 0" in _post(client, _doc(0, 0, [SAME, SAME], [1, 2])).text
    doc = _doc(0, 0, [SAME, SAME], [0, 1], environment={"torch": 2})
    assert "steps[0].environment.torch" in _post(client, doc).text
    assert client.get("/api/v1/runs/nope/ranks").status_code == 404


def test_the_reference_is_the_majority_else_the_lowest_rank() -> None:
    verdict = compare_layer("fc", {0: SAME, 1: SAME, 2: OTHER})
    assert (verdict.reference_rank, verdict.majority, verdict.differing) == (0, True, [2])
    verdict = compare_layer("fc", {0: OTHER, 1: SAME, 2: SAME})
    assert (verdict.reference_rank, verdict.majority, verdict.differing) == (1, True, [0])
    verdict = compare_layer("fc", {3: OTHER, 5: SAME})
    assert (verdict.reference_rank, verdict.majority, verdict.differing) == (3, False, [5])


@pytest.mark.parametrize(
    ("mine", "expected"),
    [
        (SAME, 0.0),
        (("ff", 1.5, 4.0), MISMATCH_FLOOR),  # other bits, same sums: above 0 all the same
        (("ff", 1.7, 4.0), 0.1),  # |1.7 − 1.5| / max(1.5, 2)
        (("ff", math.nan, 4.0), math.inf),
    ],
)
def test_mismatch_values(mine: tuple[str, float, float], expected: float) -> None:
    assert mismatch(mine, SAME) == pytest.approx(expected)


def test_an_all_zero_reference_gives_inf() -> None:
    assert mismatch(("a", 0.0, 1e-6), ("b", 0.0, 0.0)) == math.inf


def test_identity_is_the_bits_checksum_not_the_rounded_sums() -> None:
    # Another summation order on another rank rounds Σw differently; the same bits are still the same weights.
    assert mismatch((SAME[0], SAME[1] + 1e-15, SAME[2]), SAME) == 0.0


def test_ranks_posting_to_two_collector_replicas_are_compared_once(make_app: Any) -> None:
    from fastapi.testclient import TestClient

    with TestClient(make_app()) as first, TestClient(make_app()) as second:
        assert _post(first, _doc(0, 5, [SAME, SAME], [0, 1])).status_code == 200
        assert _post(second, _doc(1, 5, [SAME, OTHER], [0, 1])).status_code == 200
        for client in (first, second):
            answer = client.get("/api/v1/runs/ddp/ranks").json()
            assert (answer["compared_steps"], answer["mismatched_steps"]) == (1, 1)
            assert [m["ranks"] for m in answer["mismatches"]] == [[1]]
        (episode,) = _mismatch_episodes(first)
        assert episode["ranks"] == [1]
