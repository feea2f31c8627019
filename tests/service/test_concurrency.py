"""Several clients ingest into one run at once over real HTTP: nothing lost, layers consistent, rollups exact."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np


def test_concurrent_clients_into_one_run(
    live_collector: Any, make_batch: Callable[..., Any], encode_batch: Callable[..., Any]
) -> None:
    shared = [f"blocks.{i}" for i in range(16)]
    rng = np.random.default_rng(11)
    steps = np.arange(0, 600)
    # Clients 0 and 1 share rank 0 (even and odd steps); clients 2 and 3 are ranks 1 and 2. Each client also
    # brings a layer of its own, so layers are added to the run concurrently.
    plan = {0: (0, steps[0::2]), 1: (0, steps[1::2]), 2: (1, steps), 3: (2, steps)}
    data = {c: rng.random((s.size, len(shared) + 1), dtype=np.float32) for c, (_, s) in plan.items()}
    errors: list[str] = []

    def client(c: int) -> None:
        rank, own_steps = plan[c]
        layers = [*shared, f"extra.{c}"]
        with httpx.Client(base_url=live_collector.url, timeout=60) as http:
            for i in range(0, own_steps.size, 25):
                doc = make_batch(
                    "conc", layers, own_steps[i : i + 25].tolist(), {"m": data[c][i : i + 25]}, rank=rank, binary=True
                )
                body, headers = encode_batch(doc, "msgpack")
                r = http.post("/api/v1/ingest", content=body, headers=headers)
                if r.status_code != 200:
                    errors.append(r.text)
                    return

    threads = [threading.Thread(target=client, args=(c,)) for c in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with httpx.Client(base_url=live_collector.url, timeout=60) as http:
        layers = [x["name"] for x in http.get("/api/v1/runs/conc/layers").json()]
        assert layers[:16] == shared
        assert sorted(layers[16:]) == [f"extra.{c}" for c in range(4)]
        run = http.get("/api/v1/runs/conc").json()
        assert run["ranks"] == [0, 1, 2]
        assert run["points"] == sum(d.size for d in data.values())
        for rank, clients in ((0, (0, 1)), (1, (2,)), (2, (3,))):
            expected = np.full((steps.size, len(layers)), np.nan, dtype=np.float32)
            for c in clients:
                cols = [layers.index(n) for n in [*shared, f"extra.{c}"]]
                expected[np.ix_(plan[c][1], cols)] = data[c]
            exact = http.get(
                "/api/v1/runs/conc/heatmap", params={"metric": "m", "rank": rank, "max_steps": 1000}
            ).json()
            got = np.array([[np.nan if v is None else v for v in row] for row in exact["values"]], dtype=np.float32).T
            np.testing.assert_array_equal(got, expected)
            # Bucketed from rollups written by interleaved batches: equal to a recomputation.
            heat = http.get(
                "/api/v1/runs/conc/heatmap", params={"metric": "m", "rank": rank, "max_steps": 3, "agg": "max"}
            ).json()
            assert heat["bucket_steps"] == 256
            want = [
                [
                    float(np.nanmax(expected[b * 256 : (b + 1) * 256, j]))
                    if not np.all(np.isnan(expected[b * 256 : (b + 1) * 256, j]))
                    else None
                    for b in range(3)
                ]
                for j in range(len(layers))
            ]
            got_max = np.array([[np.nan if v is None else v for v in row] for row in heat["values"]], dtype=np.float32)
            np.testing.assert_array_equal(got_max, np.array(want, dtype=np.float64).astype(np.float32))
