"""Golden HTTP answers: a fixed sequence of requests replayed against a fresh collector, every answer compared byte for
byte (status, content type, disposition, body) with the recording in ``data/http.golden.json``.

The recording was made against the collector before its data layer became the ``service/store`` package (issue 14),
so a refactoring of the store or the routes that changes any answer fails here. Wall-clock fields (a run's
``created_at``/``last_seen_at``) are masked in place; a Parquet export is compared by its schema and rows (its bytes
name the pyarrow release that wrote them, which a fresh install may not match); everything else is compared as sent.
Re-record on purpose with ``QUANTWATCH_RECORD_GOLDEN=1``. Both backends must give the same answers: the file holds one
recording.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from fastapi.testclient import TestClient

from tests.service.conftest import batch_doc, encode

GOLDEN = Path(__file__).parent / "data" / "http.golden.json"
LAYERS = ["embed", "blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.1.attn.qkv", "blocks.1.mlp.fc1", "head"]
WALL_CLOCK = re.compile(rb'"(created_at|last_seen_at)":[0-9.e+-]+')
RULE = {
    "name": "golden_drift",
    "metric": "output_rel_l2",
    "layers": "blocks.*.attn.*",
    "op": ">",
    "threshold": 0.9,
    "consecutive": 2,
}


def _values(steps: range, seed: int, n_layers: int = len(LAYERS)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = rng.random((len(steps), n_layers), dtype=np.float32)
    under = (rng.random((len(steps), n_layers), dtype=np.float32) * 1e-3).astype(np.float32)
    under[::3, 1] = np.nan  # not measured
    return {"output_rel_l2": out, "underflow_ratio": under}


def _batch(steps: range, seed: int, batch_id: str, **kwargs: Any) -> dict[str, Any]:
    layers = kwargs.pop("layers", LAYERS)
    loss = [2.0 + 0.01 * s for s in steps]
    return batch_doc(
        "golden/a",
        layers,
        steps,
        _values(steps, seed, len(layers)),
        batch_id=batch_id,
        scalars={"loss": loss},
        **kwargs,
    )


def _requests() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx keyword arguments) in replay order."""
    ingest = "/api/v1/ingest"

    def post(doc: dict[str, Any], kind: str = "json", gzipped: bool = False) -> tuple[str, str, dict[str, Any]]:
        body, headers = encode(doc, kind, gzipped)
        return "POST", ingest, {"content": body, "headers": headers}

    yield "GET", "/healthz", {}
    yield "GET", "/readyz", {}
    yield "POST", "/api/v1/rules", {"json": RULE}
    yield post(_batch(range(16), 1, "golden-0"))
    yield post(_batch(range(16, 48), 2, "golden-1", binary=True), "msgpack")
    yield post(_batch(range(48, 300, 3), 3, "golden-2", binary=True), "msgpack", gzipped=True)
    yield post(_batch(range(16), 1, "golden-0"))  # the same batch id again: a duplicate
    nonfinite = _batch(range(300, 304), 4, "golden-3")
    nonfinite["steps"][0]["metrics"]["output_rel_l2"][0] = "nan"
    nonfinite["steps"][1]["metrics"]["output_rel_l2"][2] = "inf"
    nonfinite["steps"][2]["metrics"]["output_rel_l2"][3] = "-inf"
    yield post(nonfinite)
    # Re-sent steps under a new batch id, some layers only: last write wins per (layer, step).
    yield post(_batch(range(10, 20), 5, "golden-4", layers=LAYERS[1:3]))
    yield post(_batch(range(500, 520), 6, "golden-5", layers=[*LAYERS, "blocks.2.attn.qkv"], binary=True), "msgpack")
    yield post(_batch(range(0, 40, 2), 7, "golden-6", rank=1, binary=True), "msgpack")
    yield post(batch_doc("golden/b", LAYERS[:2], range(5), _values(range(5), 8, 2), batch_id="golden-7"))
    yield "POST", ingest, {"content": b'{"run": "x"', "headers": {"Content-Type": "application/json"}}
    yield "POST", ingest, {"json": {"run": "x", "rank": 0, "batch_id": "b", "layers": [], "steps": "no"}}
    yield "POST", ingest, {"json": {"rank": 0, "batch_id": "b", "layers": ["a"], "steps": []}}
    yield "POST", ingest, {"content": b"{}", "headers": {"Content-Type": "text/plain"}}
    bad_width = _batch(range(2), 9, "golden-bad")
    bad_width["steps"][0]["metrics"]["output_rel_l2"] = [0.1]
    yield post(bad_width)
    yield "GET", "/api/v1/runs", {}
    yield "GET", "/api/v1/runs/golden/a", {}
    yield "GET", "/api/v1/runs/golden/a/layers", {}
    series = "/api/v1/runs/golden/a/series"
    for layer in ("embed", "blocks.0.attn.qkv", "blocks.2.attn.qkv"):
        yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": layer}}
    for max_points in (1, 7, 50, 100):
        yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": LAYERS[1], "max_points": max_points}}
    yield "GET", series, {"params": {"metric": "underflow_ratio", "layer": "blocks.0.attn.qkv", "max_points": 20}}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": "head", "start": 9, "end": 70}}
    tail = {"start": 9, "end": 270, "max_points": 9}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": "head", **tail}}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": "embed", "rank": 1, "max_points": 4}}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": "embed", "rank": 7}}
    yield "GET", series, {"params": {"scalar": "loss"}}
    yield "GET", series, {"params": {"scalar": "loss", "max_points": 10, "start": 3}}
    yield "GET", series, {"params": {"metric": "output_rel_l2"}}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "scalar": "loss"}}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": "embed", "start": 9, "end": 2}}
    yield "GET", series, {"params": {"metric": "output_rel_l2", "layer": "nope"}}
    yield "GET", series, {"params": {"metric": "nope", "layer": "embed"}}
    yield "GET", series, {"params": {"scalar": "nope"}}
    yield "GET", "/api/v1/runs/nope/series", {"params": {"metric": "output_rel_l2", "layer": "embed"}}
    heatmap = "/api/v1/runs/golden/a/heatmap"
    yield "GET", heatmap, {"params": {"metric": "output_rel_l2"}}
    yield "GET", heatmap, {"params": {"metric": "output_rel_l2", "max_steps": 8}}
    yield "GET", heatmap, {"params": {"metric": "output_rel_l2", "max_steps": 8, "agg": "mean"}}
    yield "GET", heatmap, {"params": {"metric": "underflow_ratio", "max_steps": 30, "agg": "min", "start": 4}}
    yield "GET", heatmap, {"params": {"metric": "output_rel_l2", "layers": "blocks.*.attn.*", "end": 40}}
    yield "GET", heatmap, {"params": {"metric": "output_rel_l2", "layers": "zzz*"}}
    yield "GET", heatmap, {"params": {"metric": "output_rel_l2", "rank": 1, "max_steps": 3}}
    yield "GET", heatmap, {"params": {"metric": "nope"}}
    yield "GET", "/api/v1/runs/nope/heatmap", {"params": {"metric": "output_rel_l2"}}
    yield "GET", "/api/v1/runs/golden/a/export", {}
    yield "GET", "/api/v1/runs/golden/a/export", {"params": {"format": "parquet"}}
    yield "GET", "/api/v1/runs/golden/b/export", {"params": {"format": "csv"}}
    yield "GET", "/api/v1/runs/nope/export", {}
    yield "GET", "/api/v1/runs/nope/layers", {}
    yield "GET", "/api/v1/runs/nope", {}
    yield "GET", "/api/v1/alerts", {}
    yield "GET", "/api/v1/alerts", {"params": {"state": "firing", "run": "golden/a"}}
    yield "GET", "/api/v1/deliveries", {}
    yield "POST", "/api/v1/deliveries/999/redeliver", {}
    yield "GET", "/api/v1/rules/golden_drift", {}
    yield "GET", "/api/v1/rules/nope", {}
    yield "PUT", "/api/v1/rules/golden_drift", {"json": {**RULE, "threshold": 0.95}}
    yield "PUT", "/api/v1/rules/golden_drift", {"json": {**RULE, "name": "other"}}
    yield "POST", "/api/v1/rules", {"json": RULE}
    yield "GET", "/api/v1/rules", {}
    yield "DELETE", "/api/v1/rules/golden_drift", {}
    yield "DELETE", "/api/v1/rules/golden_drift", {}
    receiver = {"name": "ops", "url": "http://127.0.0.1:9/hook", "enabled": False}
    yield "POST", "/api/v1/receivers", {"json": receiver}
    yield "POST", "/api/v1/receivers", {"json": receiver}
    yield "GET", "/api/v1/receivers", {}
    yield "GET", "/api/v1/receivers/ops", {}
    yield "PUT", "/api/v1/receivers/ops", {"json": {**receiver, "url": "http://127.0.0.1:9/other"}}
    yield "DELETE", "/api/v1/receivers/ops", {}
    yield "GET", "/api/v1/receivers/ops", {}
    yield "DELETE", "/api/v1/runs/golden/b", {}
    yield "DELETE", "/api/v1/runs/golden/b", {}
    yield "GET", "/api/v1/runs", {}


def _parquet_content(body: bytes) -> bytes:
    """The table a Parquet body holds, as canonical JSON: its schema (names, types, metadata) and every row."""
    table = pq.read_table(io.BytesIO(body))
    return json.dumps({"schema": str(table.schema), "rows": table.to_pylist()}, sort_keys=True).encode()


def _answer(response: Any) -> dict[str, Any]:
    body = WALL_CLOCK.sub(rb'"\1":"wall-clock"', response.content)
    media = response.headers.get("content-type", "")
    if media == "application/vnd.apache.parquet":
        body = _parquet_content(body)
    # Large bodies are kept as their digest (the file stays small); the small ones as text, for readable diffs.
    text = body.decode() if len(body) <= 4096 else f"sha256:{hashlib.sha256(body).hexdigest()} ({len(body)} bytes)"
    return {
        "status": response.status_code,
        "content_type": media,
        "content_disposition": response.headers.get("content-disposition"),
        "body": text,
    }


def test_answers_match_the_recording(make_app: Any) -> None:
    with TestClient(make_app()) as client:
        answers = [
            {"request": f"{method} {path} {kw.get('params', '')}", **_answer(client.request(method, path, **kw))}
            for method, path, kw in _requests()
        ]
    if os.environ.get("QUANTWATCH_RECORD_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert len(answers) == len(expected)
    for got, want in zip(answers, expected, strict=True):
        assert got == want, got["request"]
