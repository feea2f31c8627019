"""Estimated figures (a step's ``estimated`` on the wire): stored per (run, rank, metric, step), answered by the series
route as the buckets holding one, kept by migration 0005 and dropped with its downgrade."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import inspect

from alembic import command
from quantwatch.service.core.config import Settings
from quantwatch.service.core.db import alembic_config, make_engine, upgrade
from tests.service.conftest import batch_doc

STEPS = list(range(16))


def _run_with_estimates(post_batch: Callable[..., Any], estimated_steps: set[int], kind: str) -> None:
    values = np.arange(2 * len(STEPS), dtype=np.float32).reshape(len(STEPS), 2) / 100
    doc = batch_doc("est", ["a", "b"], STEPS, {"m": values, "exact": values}, scalars={"loss": [1.0] * len(STEPS)})
    for entry in doc["steps"]:
        if entry["step"] in estimated_steps:
            entry["estimated"] = ["m"]
    response = post_batch(doc, kind)
    assert response.status_code == 200, response.text


def test_series_answer_the_buckets_holding_an_estimated_point(post_batch: Callable[..., Any], client: Any) -> None:
    _run_with_estimates(post_batch, {3, 9, 10}, "msgpack")

    def series(**params: Any) -> Any:
        return client.get("/api/v1/runs/est/series", params={"layer": "b", **params}).json()

    assert series(metric="m")["estimated"] == [3, 9, 10]  # exact: one step per bucket
    assert series(metric="m", start=4)["estimated"] == [9, 10]
    bucketed = series(metric="m", max_points=4)  # buckets of 4 steps: 0-3, 4-7, 8-11, 12-15
    assert bucketed["bucket_steps"] == 4
    assert bucketed["estimated"] == [0, 8]
    assert series(metric="m", start=2, max_points=4)["estimated"] == [2, 8]  # the first bucket clipped to start
    assert series(metric="exact")["estimated"] == []  # only the metrics the step names
    assert client.get("/api/v1/runs/est/series", params={"scalar": "loss"}).json()["estimated"] == []
    assert series(metric="m", rank=1)["estimated"] == []


def test_a_resent_batch_stores_each_mark_once(post_batch: Callable[..., Any], client: Any) -> None:
    _run_with_estimates(post_batch, {5}, "json")
    _run_with_estimates(post_batch, {5, 6}, "json")
    answer = client.get("/api/v1/runs/est/series", params={"metric": "m", "layer": "a"}).json()
    assert answer["estimated"] == [5, 6]
    assert client.delete("/api/v1/runs/est").status_code == 204  # the marks go with the run (cascade)
    _run_with_estimates(post_batch, set(), "json")
    assert client.get("/api/v1/runs/est/series", params={"metric": "m", "layer": "a"}).json()["estimated"] == []


def test_migration_0006_adds_and_drops_the_estimated_points(empty_database_url: str) -> None:
    engine = make_engine(Settings(database_url=empty_database_url))
    try:
        upgrade(engine)
        assert "estimated_points" in inspect(engine).get_table_names()
        cfg = alembic_config(empty_database_url)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0005_ranks")
        assert "estimated_points" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
