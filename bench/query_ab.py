"""Series and heatmap latency of two or more collector source trees, side by side on one database (issue 3).

Fills a database (unless it already holds the run) with bench/ingest.py's query run — 100,000 steps × 512 layers of
one metric in 1,000-step batches, through the store of the tree this script runs from — then serves it with one
``quantwatch serve`` per tree at once (each importing its own tree, schema upgrades off) and alternates the same
requests between them, so every tree sees the same machine load. Answers must be byte-identical across trees.

    PYTHONPATH=$PWD .venv/bin/python bench/query_ab.py sqlite:////tmp/q.db /work/main $PWD
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx
from ingest import HEALTHY_SCALE, LAYERS, encode_batch, workload_values

from quantwatch.service.batch import decode_msgpack
from quantwatch.service.core.config import Settings
from quantwatch.service.core.db import make_engine, make_sessionmaker, upgrade
from quantwatch.service.server import free_port, wait_until_ready
from quantwatch.service.store import NotFoundError, Store

RUN = "bench-query"
QUERIES = {
    "series": (f"/api/v1/runs/{RUN}/series", {"metric": "output_rel_l2", "layer": LAYERS[300], "max_points": 1000}),
    "heatmap": (f"/api/v1/runs/{RUN}/heatmap", {"metric": "output_rel_l2", "max_steps": 500}),
}


def fill(url: str, steps: int) -> None:
    """The query run of bench/ingest.py, stored in-process (skipped when the run exists)."""
    engine = make_engine(Settings(database_url=url))
    upgrade(engine)
    store = Store(engine, make_sessionmaker(engine))
    try:
        store.run_id(RUN)
    except NotFoundError:
        values = workload_values(0, HEALTHY_SCALE)
        for s in range(0, steps, 1000):
            body = encode_batch(RUN, 0, range(s, min(s + 1000, steps)), ["output_rel_l2"], values)
            store.ingest(decode_msgpack(body))
        store.wait_for_folds()  # folded before the engine goes: reads are timed over the chunks they will meet
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("database_url")
    parser.add_argument("trees", nargs="+", help="source trees (repository roots) to serve from")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=300, help="series requests per tree (heatmap: a tenth)")
    args = parser.parse_args()
    fill(args.database_url, args.steps)
    servers = []
    for tree in args.trees:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": tree, "QUANTWATCH_AUTO_UPGRADE": "false"}
        cmd = [sys.executable, "-m", "quantwatch.cli", "serve", "--database-url", args.database_url]
        proc = subprocess.Popen([*cmd, "--port", str(port), "--log-level", "warning"], env=env, cwd=tree)
        servers.append((proc, f"http://127.0.0.1:{port}"))
    try:
        clients = []
        for proc, base in servers:
            wait_until_ready(proc, f"{base}/readyz", 120, "collector")
            clients.append(httpx.Client(base_url=base, timeout=120))
        for name, (path, params) in QUERIES.items():
            bodies = {c.get(path, params=params).content for c in clients}
            if len(bodies) != 1:
                raise SystemExit(f"{name}: the trees answer differently")
            reps = args.reps if name == "series" else max(1, args.reps // 10)
            times: list[list[float]] = [[] for _ in clients]
            for i in range(reps):
                for j in range(len(clients)) if i % 2 else reversed(range(len(clients))):
                    t0 = time.perf_counter()
                    clients[j].get(path, params=params).raise_for_status()
                    times[j].append(time.perf_counter() - t0)
            print(f"{name} ({reps} requests per tree, load average {os.getloadavg()[0]:.1f}):")
            for tree, ts in zip(args.trees, times, strict=True):
                ms = sorted(1000 * t for t in ts)
                p90 = ms[int(len(ms) * 0.9)]
                print(f"  {tree}: p50 {statistics.median(ms):.2f} ms  p90 {p90:.2f}  min {ms[0]:.2f}")
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
