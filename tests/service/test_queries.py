"""History queries: exact and bucketed series and heatmaps against a numpy recomputation, runs, export."""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

LAYERS = ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "head"]


def f32(values: list[Any]) -> np.ndarray:
    """JSON floats (float32 values travel as their shortest float32 text) back to float32; None as NaN."""
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float32)


def assert_means(got: list[Any], want: list[Any], width: int) -> None:
    """Exact answers carry the stored float32 itself; bucket means are float64 sums over counts."""
    if width == 1:
        np.testing.assert_array_equal(f32(got), f32(want))
    else:
        np.testing.assert_allclose(np.array(got, dtype=float), np.array(want, dtype=float), rtol=1e-12)


def _width(lo: int, hi: int, max_points: int) -> int:
    width = 1
    while hi // width - lo // width + 1 > max_points:
        width *= 2
    return width


def _oracle(
    steps: np.ndarray, values: np.ndarray, lo: int, hi: int, max_points: int, exact_ok: bool = True
) -> dict[str, Any]:
    """Bucket min/mean/max recomputed from the raw points (NaN in ``values`` = not measured here)."""
    inside = (steps >= lo) & (steps <= hi)
    width = 1 if exact_ok and inside.sum() <= max_points else _width(lo, hi, max_points)
    s, v = steps[inside], values[inside]
    keep = ~np.isnan(v)
    s, v = s[keep], v[keep].astype(np.float64)
    out: dict[str, list[Any]] = {"steps": [], "min": [], "mean": [], "max": []}
    for b in np.unique(s // width):
        sel = v[s // width == b]
        out["steps"].append(int(max(b * width, lo)))
        out["min"].append(float(np.float32(sel.min())))
        out["max"].append(float(np.float32(sel.max())))
        out["mean"].append(float(sel.sum() / sel.size))
    return {**out, "bucket_steps": width}


def _ingest_history(
    post_batch: Callable[..., Any], make_batch: Callable[..., Any], run: str, seed: int, batch_sizes: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    steps = np.sort(rng.choice(np.arange(0, 9000), size=5000, replace=False)).astype(np.int64)
    values = rng.standard_normal((steps.size, len(LAYERS))).astype(np.float32)
    values[rng.random(values.shape) < 0.05] = np.nan  # not measured
    i, k = 0, 0
    while i < steps.size:
        n = batch_sizes[k % len(batch_sizes)]
        k += 1
        doc = make_batch(run, LAYERS, steps[i : i + n].tolist(), {"output_rel_l2": values[i : i + n]})
        r = post_batch(doc)
        assert r.status_code == 200, r.text
        i += n
    return steps, values


@pytest.fixture
def history(post_batch: Callable[..., Any], make_batch: Callable[..., Any]) -> tuple[np.ndarray, np.ndarray]:
    return _ingest_history(post_batch, make_batch, "hist", 7, [1, 37, 500, 3, 129])


QUERIES = [
    (None, None, 100_000),
    (None, None, 1000),
    (None, None, 50),
    (None, None, 10),
    (None, None, 2),
    (3, 8999, 7),
    (100, 4000, 33),
    (64, 4095, 16),
    (1234, 1300, 5),
    # Bucket width 128 (the level added for long series): whole range, and partial blocks at both edges.
    (None, None, 100),
    (130, 1000, 7),
    (5, 8990, 80),
    # Width 512: level 256, two blocks per bucket.
    (None, None, 20),
]


def test_series_matches_numpy_recomputation(client: Any, history: tuple[np.ndarray, np.ndarray]) -> None:
    steps, values = history
    for start, end, max_points in QUERIES:
        lo = int(steps[0]) if start is None else start
        hi = int(steps[-1]) if end is None else end
        for layer in (0, 3):
            params = {"metric": "output_rel_l2", "layer": LAYERS[layer], "max_points": max_points}
            params.update({k: v for k, v in (("start", start), ("end", end)) if v is not None})
            got = client.get("/api/v1/runs/hist/series", params=params).json()
            want = _oracle(steps, values[:, layer], lo, hi, max_points)
            assert got["bucket_steps"] == want["bucket_steps"], params
            assert got["steps"] == want["steps"], params
            assert len(got["steps"]) <= max_points
            np.testing.assert_array_equal(f32(got["min"]), f32(want["min"]), err_msg=str(params))
            np.testing.assert_array_equal(f32(got["max"]), f32(want["max"]), err_msg=str(params))
            assert_means(got["mean"], want["mean"], got["bucket_steps"])
            if got["bucket_steps"] == 1:
                assert got["min"] == got["mean"] == got["max"]
            assert client.get("/api/v1/runs/hist/series", params=params).json() == got


HEATMAPS = [(None, None, 500), (None, None, 12), (10, 5000, 40), (0, 63, 64)]


def test_heatmap_matches_numpy_recomputation(client: Any, history: tuple[np.ndarray, np.ndarray]) -> None:
    steps, values = history
    for (start, end, max_steps), agg in itertools.product(HEATMAPS, ("max", "mean", "min")):
        lo = int(steps[0]) if start is None else start
        hi = int(steps[-1]) if end is None else end
        params: dict[str, Any] = {"metric": "output_rel_l2", "max_steps": max_steps, "agg": agg}
        params.update({k: v for k, v in (("start", start), ("end", end)) if v is not None})
        got = client.get("/api/v1/runs/hist/heatmap", params=params).json()
        width = _width(lo, hi, max_steps)
        grid = list(range(lo // width, hi // width + 1))
        assert got["layers"] == LAYERS
        assert got["bucket_steps"] == width
        assert got["steps"] == [max(b * width, lo) for b in grid]
        assert len(got["steps"]) <= max_steps
        for j in range(len(LAYERS)):
            want = _oracle(steps, values[:, j], lo, hi, max_steps, exact_ok=False)
            by_step = dict(zip(want["steps"], want[agg], strict=True))
            row = [by_step.get(s) for s in got["steps"]]
            if agg == "mean":
                assert_means(got["values"][j], row, width)

            else:
                np.testing.assert_array_equal(f32(got["values"][j]), f32(row), err_msg=str(params))


def test_nonfinite_values_propagate_through_buckets(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    vals = np.ones((4096, 3), dtype=np.float32)
    vals[100, 0] = np.nan
    vals[3000, 1] = np.inf
    doc = make_batch("nf", ["a", "b", "c"], list(range(4096)), {"m": vals}, binary=True)
    assert post_batch(doc, "msgpack").status_code == 200
    heat = client.get("/api/v1/runs/nf/heatmap", params={"metric": "m", "max_steps": 4, "agg": "max"}).json()
    assert heat["bucket_steps"] == 1024
    assert heat["values"] == [["nan", 1.0, 1.0, 1.0], [1.0, 1.0, "inf", 1.0], [1.0, 1.0, 1.0, 1.0]]
    s = client.get("/api/v1/runs/nf/series", params={"metric": "m", "layer": "b", "max_points": 2}).json()
    assert s["min"] == [1.0, 1.0]
    assert s["max"] == [1.0, "inf"]
    assert s["mean"] == [1.0, "inf"]


def test_batch_boundaries_do_not_change_answers(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    _ingest_history(post_batch, make_batch, "split-a", 3, [1000])
    _ingest_history(post_batch, make_batch, "split-b", 3, [1, 7, 64, 250])
    for params in ({"max_steps": 20}, {"max_steps": 300, "agg": "mean"}):
        a = client.get("/api/v1/runs/split-a/heatmap", params={"metric": "output_rel_l2", **params}).json()
        b = client.get("/api/v1/runs/split-b/heatmap", params={"metric": "output_rel_l2", **params}).json()
        assert a["steps"] == b["steps"]
        np.testing.assert_allclose(np.array(a["values"], dtype=float), np.array(b["values"], dtype=float), rtol=1e-12)


def test_replaced_points_update_rollups(
    client: Any, history: tuple[np.ndarray, np.ndarray], post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    steps, values = history
    chosen = steps[::97][:40]
    new = np.full((chosen.size, len(LAYERS)), 100.0, dtype=np.float32)
    new[:, 1] = np.nan  # layer 1 not re-measured: keeps its old values
    assert post_batch(make_batch("hist", LAYERS, chosen.tolist(), {"output_rel_l2": new})).status_code == 200
    expected = values.copy()
    rows = np.searchsorted(steps, chosen)
    expected[rows[:, None], [0, 2, 3, 4]] = 100.0
    for layer in range(len(LAYERS)):
        got = client.get(
            "/api/v1/runs/hist/series", params={"metric": "output_rel_l2", "layer": LAYERS[layer], "max_points": 9}
        ).json()
        want = _oracle(steps, expected[:, layer], int(steps[0]), int(steps[-1]), 9)
        np.testing.assert_array_equal(f32(got["max"]), f32(want["max"]))
        np.testing.assert_array_equal(f32(got["min"]), f32(want["min"]))
        np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-12)


def test_heatmap_layer_order_and_glob(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    names = ["z.first", "a.second", "m.third.mlp", "b.fourth.mlp"]
    vals = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert post_batch(make_batch("order", names, [0, 1], {"m": vals})).status_code == 200
    heat = client.get("/api/v1/runs/order/heatmap", params={"metric": "m"}).json()
    assert heat["layers"] == names
    assert heat["values"] == vals.T.tolist()
    mlp = client.get("/api/v1/runs/order/heatmap", params={"metric": "m", "layers": "*.mlp"}).json()
    assert mlp["layers"] == ["m.third.mlp", "b.fourth.mlp"]
    assert mlp["values"] == [[2.0, 6.0], [3.0, 7.0]]


def test_scalar_series_bucketed(client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]) -> None:
    steps = np.arange(0, 300)
    loss = np.linspace(5, 1, steps.size)
    doc = make_batch("scal", ["a"], steps.tolist(), {"m": np.zeros((steps.size, 1))}, scalars={"loss": loss.tolist()})
    assert post_batch(doc).status_code == 200
    got = client.get("/api/v1/runs/scal/series", params={"scalar": "loss", "max_points": 10}).json()
    width = _width(0, 299, 10)
    assert got["bucket_steps"] == width
    buckets = steps // width
    assert got["steps"] == [int(b * width) for b in np.unique(buckets)]
    assert got["max"] == [float(loss[buckets == b].max()) for b in np.unique(buckets)]
    np.testing.assert_allclose(got["mean"], [loss[buckets == b].mean() for b in np.unique(buckets)], rtol=1e-12)


def test_runs_listing_and_detail(client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]) -> None:
    assert post_batch(make_batch("org/a", ["l"], [5, 6], {"m": np.ones((2, 1))}, rank=1)).status_code == 200
    assert (
        post_batch(make_batch("org/a", ["l", "k"], [2], {"n": np.ones((1, 2))}, scalars={"loss": [1.0]})).status_code
        == 200
    )
    assert post_batch(make_batch("b", ["l"], [0], {"m": np.ones((1, 1))})).status_code == 200
    runs = client.get("/api/v1/runs").json()
    assert [r["name"] for r in runs] == ["b", "org/a"]
    detail = client.get("/api/v1/runs/org/a").json()
    assert detail == runs[1]
    assert detail["first_step"] == 2
    assert detail["last_step"] == 6
    assert detail["ranks"] == [0, 1]
    assert detail["layer_count"] == 2
    assert detail["metrics"] == ["m", "n"]
    assert detail["scalars"] == ["loss"]
    assert detail["points"] == 5
    assert detail["firing_alerts"] == 0
    assert detail["last_seen_at"] >= detail["created_at"]


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/api/v1/runs/nope", {}),
        ("/api/v1/runs/nope/layers", {}),
        ("/api/v1/runs/known/series", {"metric": "m", "layer": "nope"}),
        ("/api/v1/runs/known/series", {"metric": "nope", "layer": "a"}),
        ("/api/v1/runs/known/series", {"scalar": "nope"}),
        ("/api/v1/runs/known/heatmap", {"metric": "nope"}),
        ("/api/v1/runs/nope/export", {}),
        ("/api/v1/nothing-here", {}),
    ],
)
def test_unknown_things_are_404(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any], path: str, params: dict[str, str]
) -> None:
    assert post_batch(make_batch("known", ["a"], [0], {"m": np.ones((1, 1))})).status_code == 200
    r = client.get(path, params=params)
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("/not-found")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"metric": "m"}, "query.layer"),
        ({}, "query.metric"),
        ({"scalar": "x", "max_points": 0}, "query.max_points"),
        ({"scalar": "x", "start": 5, "end": 1}, "query.start"),
    ],
)
def test_bad_query_is_422_naming_the_field(client: Any, params: dict[str, Any], field: str) -> None:
    r = client.get("/api/v1/runs/any/series", params=params)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == field


def test_delete_run(client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]) -> None:
    doc = make_batch("gone", ["a"], [0, 1], {"m": np.ones((2, 1))}, scalars={"loss": [1.0, 2.0]})
    assert post_batch(doc).status_code == 200
    assert client.delete("/api/v1/runs/gone").status_code == 204
    assert client.get("/api/v1/runs/gone").status_code == 404
    assert client.delete("/api/v1/runs/gone").status_code == 404
    # The same name starts afresh, and the old batch id is no longer a duplicate.
    again = post_batch(doc)
    assert again.json()["duplicate"] is False
    assert client.get("/api/v1/runs/gone/layers").json() == [
        {"index": 0, "name": "a", "formats": None, "format_changes": []}
    ]


def test_export_of_a_run_of_scalars_only_holds_its_scalars(client: Any, post_batch: Callable[..., Any]) -> None:
    doc = {
        "run": "scalars",
        "batch_id": "s",
        "layers": [],
        "steps": [{"step": 3, "metrics": {}, "scalars": {"loss": 2.5}}],
    }
    assert post_batch(doc).status_code == 200
    r = client.get("/api/v1/runs/scalars/export", params={"format": "csv"})
    assert r.status_code == 200
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert [(x["kind"], x["name"], int(x["step"]), float(x["value"])) for x in rows] == [("scalar", "loss", 3, 2.5)]


def test_export_csv_and_parquet_hold_every_point_exactly(
    client: Any, post_batch: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    rng = np.random.default_rng(5)
    vals = rng.standard_normal((300, 3)).astype(np.float32)
    vals[0, 1] = np.nan
    vals[1, 2] = np.float32(np.inf)
    doc = make_batch(
        "exp", ["a", "b", "c"], list(range(300)), {"m": vals}, binary=True, scalars={"loss": list(range(300))}
    )
    doc["steps"][0]["metrics"]["m"] = [0.5, "nan", None]  # JSON-style array inside msgpack: layer c not measured
    assert post_batch(doc, "msgpack").status_code == 200
    expected = {(s, layer): float(vals[s, j]) for s in range(300) for j, layer in enumerate("abc")}
    expected[(0, "a")] = 0.5
    del expected[(0, "c")]
    r = client.get("/api/v1/runs/exp/export", params={"format": "csv"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    metric_rows = {(int(x["step"]), x["layer"]): float(x["value"]) for x in rows if x["kind"] == "metric"}
    assert metric_rows.keys() == expected.keys()
    for key, value in expected.items():
        assert np.float32(metric_rows[key]) == np.float32(value) or (np.isnan(value) and np.isnan(metric_rows[key]))
    assert sorted(int(float(x["value"])) for x in rows if x["kind"] == "scalar") == list(range(300))

    import pyarrow.parquet as pq

    p = client.get("/api/v1/runs/exp/export", params={"format": "parquet"})
    assert p.status_code == 200
    table = pq.read_table(io.BytesIO(p.content)).to_pydict()
    got = {
        (s, layer): v
        for s, layer, kind, v in zip(table["step"], table["layer"], table["kind"], table["value"], strict=True)
        if kind == "metric"
    }
    assert got.keys() == expected.keys()
    assert all(np.float32(got[k]) == np.float32(v) or np.isnan(v) for k, v in expected.items())
