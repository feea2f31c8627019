"""GET /metrics of a real collector over HTTP: the cache fed by ingest's after-commit hook, the ingest counters."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/ingest", content=body, headers=headers, timeout=10)


def test_metrics_follow_ingest(
    start_collector: Callable[..., Any],
    make_batch: Callable[..., dict[str, Any]],
    encode_batch: Callable[..., tuple[bytes, dict[str, str]]],
) -> None:
    collector = start_collector(metrics_top_k=2)
    layers = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.1.attn.qkv"]
    rel = np.array([[0.01, 0.2, 0.03], [0.07, np.nan, 0.02]], np.float32)  # NaN in JSON = null: not measured
    doc = make_batch("gpt-fp4", layers, [10, 11], {"output_rel_l2": rel}, scalars={"loss": [2.9, 2.8]})
    body, headers = encode_batch(doc, "msgpack")
    assert post(collector.url, body, headers).json()["duplicate"] is False
    assert post(collector.url, body, headers).json()["duplicate"] is True
    assert post(collector.url, b"{", {"Content-Type": "application/json"}).status_code == 400

    got = scrape(collector.url)
    layer_values = {dict(k)["layer"]: v for k, v in got["quantwatch_layer_output_rel_l2_ratio"].items()}
    # Step 11 measured qkv (0.07) and blocks.1 (0.02); fc1 keeps its step-10 value (0.2); the cap keeps the worst 2.
    assert layer_values == {"blocks.0.attn.qkv": 0.07, "blocks.0.mlp.fc1": 0.2}  # shortest float32 spelling
    assert got["quantwatch_run_loss"] == {(("rank", "0"), ("run", "gpt-fp4")): 2.8}
    assert got["quantwatch_run_last_step"] == {(("rank", "0"), ("run", "gpt-fp4")): 11.0}
    assert got["quantwatch_ingest_points_total"][()] == 5 + 2  # 5 measured layer values + 2 scalars, stored once
    outcomes = {dict(k)["outcome"]: v for k, v in got["quantwatch_ingest_requests_total"].items()}
    assert outcomes == {"accepted": 1.0, "duplicate": 1.0, "rejected": 1.0, "throttled": 0.0, "error": 0.0}
    assert got["quantwatch_ingest_request_duration_seconds_count"][()] == 3.0
    assert got["quantwatch_exposition_layer_series_omitted"] == {(("metric", "output_rel_l2"),): 1.0}


def test_a_running_collector_renders_changed_layers_before_the_scrape(
    start_collector: Callable[..., Any],
    make_batch: Callable[..., dict[str, Any]],
    encode_batch: Callable[..., tuple[bytes, dict[str, str]]],
) -> None:
    collector = start_collector()
    renderer = collector.app.state.exposition.renderer
    scrape(collector.url)  # the renderer works once someone scrapes
    rel = np.array([[0.5, 0.25]], np.float32)
    body, headers = encode_batch(make_batch("bg", ["a", "b"], [1], {"output_rel_l2": rel}))
    assert post(collector.url, body, headers).status_code == 200
    deadline = time.monotonic() + 30
    while renderer.slots_rendered == 0:  # the app's lifespan started the renderer; no scrape since the batch
        assert time.monotonic() < deadline, "the background renderer did not render the batch"
        time.sleep(0.02)
    layer_values = {
        dict(k)["layer"]: v for k, v in scrape(collector.url)["quantwatch_layer_output_rel_l2_ratio"].items()
    }
    assert layer_values == {"a": 0.5, "b": 0.25}


def test_a_scrape_right_after_an_acknowledged_batch_shows_it(
    start_collector: Callable[..., Any],
    make_batch: Callable[..., dict[str, Any]],
    encode_batch: Callable[..., tuple[bytes, dict[str, str]]],
) -> None:
    # Batches wait in the cache until a render or a scrape merges them (issue 21): whichever comes first, a scrape
    # after a batch's 200 shows it, and batches that waited together show per layer the newest value measured.
    collector = start_collector()
    scrape(collector.url)  # the background renderer works from now on, racing the posts below
    layers = ["a", "b", "c"]

    def values() -> dict[str, float]:
        got = scrape(collector.url)["quantwatch_layer_output_rel_l2_ratio"]
        return {dict(k)["layer"]: v for k, v in got.items() if dict(k)["rank"] == "1"}

    for step in range(1, 13):
        rel = np.array([[step / 16, step / 32, step / 64]], np.float32)
        body, headers = encode_batch(make_batch("now", layers, [step], {"output_rel_l2": rel}, rank=1))
        assert post(collector.url, body, headers).status_code == 200
        assert values() == {"a": step / 16, "b": step / 32, "c": step / 64}
    for step, rel in ((20, [0.5, np.nan, np.nan]), (21, [np.nan, 0.75, np.nan])):  # NaN in JSON = null
        doc = make_batch("now", layers, [step], {"output_rel_l2": np.array([rel], np.float32)}, rank=1)
        assert post(collector.url, *encode_batch(doc)).status_code == 200
    assert values() == {"a": 0.5, "b": 0.75, "c": 12 / 64}


def test_promtool_accepts_the_live_exposition(
    live_collector: Any,
    make_batch: Callable[..., dict[str, Any]],
    encode_batch: Callable[..., tuple[bytes, dict[str, str]]],
) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: .ci/run installs the Debian package prometheus"
    layers = [f"blocks.{i}.mlp.fc1" for i in range(8)]
    values = {m: np.random.default_rng(0).random((3, 8)).astype(np.float32) for m in ("output_cosine", "amax")}
    doc = make_batch("r", layers, [1, 2, 3], values, scalars={"tokens_per_second": [1e4, 1e4, 1e4]})
    body, headers = encode_batch(doc)
    assert post(live_collector.url, body, headers).status_code == 200
    text = httpx.get(f"{live_collector.url}/metrics", timeout=10).content
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")
