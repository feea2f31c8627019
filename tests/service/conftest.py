"""Helpers for the service tests: batch builders in the agent's encodings."""

from __future__ import annotations

import gzip
import json
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest


def batch_doc(
    run: str,
    layers: Sequence[str],
    steps: Sequence[int],
    values: dict[str, np.ndarray],
    *,
    rank: int = 0,
    batch_id: str | None = None,
    binary: bool = False,
    scalars: dict[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """A batch document; ``values[metric]`` is ``[len(steps), len(layers)]`` float32 (NaN = ``null`` unless binary)."""
    out_steps = []
    for i, step in enumerate(steps):
        metrics: dict[str, Any] = {}
        for name, arr in values.items():
            row = np.asarray(arr[i], dtype=np.float32)
            if binary:
                metrics[name] = row.astype("<f4").tobytes()
            else:
                metrics[name] = [None if np.isnan(v) else float(v) for v in row.tolist()]
        entry: dict[str, Any] = {"step": int(step), "time": 1_700_000_000.0 + step, "metrics": metrics}
        if scalars:
            entry["scalars"] = {k: float(v[i]) for k, v in scalars.items()}
        out_steps.append(entry)
    return {
        "run": run,
        "rank": rank,
        "batch_id": batch_id or uuid.uuid4().hex,
        "layers": list(layers),
        "steps": out_steps,
    }


def encode(doc: dict[str, Any], kind: str = "json", gzipped: bool = False) -> tuple[bytes, dict[str, str]]:
    """Body and headers for ``doc`` as JSON or msgpack, optionally gzip."""
    if kind == "json":
        body, ctype = json.dumps(doc).encode(), "application/json"
    else:
        body, ctype = msgpack.packb(doc, use_bin_type=True), "application/msgpack"
    headers = {"Content-Type": ctype}
    if gzipped:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return body, headers


@pytest.fixture
def post_batch(client: Any) -> Callable[..., Any]:
    """``post_batch(doc, kind="json"|"msgpack", gzipped=False)`` → the response of the in-process client."""

    def post(doc: dict[str, Any], kind: str = "json", gzipped: bool = False) -> Any:
        body, headers = encode(doc, kind, gzipped)
        return client.post("/api/v1/ingest", content=body, headers=headers)

    return post


@pytest.fixture
def make_batch() -> Callable[..., dict[str, Any]]:
    """The :func:`batch_doc` builder."""
    return batch_doc


@pytest.fixture
def encode_batch() -> Callable[..., tuple[bytes, dict[str, str]]]:
    """The :func:`encode` encoder."""
    return encode


class HoldingObserver:
    """An ingest observer that holds the batch ``hold_id`` inside its storing transaction until released."""

    def __init__(self, hold_id: str) -> None:
        self.hold_id = hold_id
        self.entered = threading.Event()
        self.release = threading.Event()

    def on_batch(self, session: Any, run_row: Any, batch: Any) -> None:
        if batch.batch_id == self.hold_id:
            self.entered.set()
            assert self.release.wait(30), "the test never released the held batch"

    def after_commit(self, batch: Any) -> None:
        pass
