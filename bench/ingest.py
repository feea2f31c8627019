"""Collector ingest and query benchmark (issue 3), side by side with an MLflow tracking server.

Starts a real ``quantwatch serve`` (uvicorn on loopback) on SQLite, then on PostgreSQL, and drives it from
concurrent client processes sending the agent's binary encoding (msgpack, float32 ``bin`` per metric) of 512 layers ×
8 metrics per step. Prints acknowledged points/s (each 200 means committed), p50/p99 request latency, bytes per point
on disk, then fills one run with 100,000 steps × 512 layers and times a 512 × 500 heatmap and a 1,000-point series.
Finally sends the same workload through MLflow's ``log-batch`` REST endpoint (if MLflow is installed) and prints the
ratio.

    .venv/bin/python bench/ingest.py                 # everything (several minutes)
    .venv/bin/python bench/ingest.py --seconds 10 --skip-postgres --query-steps 20000
    .venv/bin/python bench/ingest.py --clients 8 --many-ranks --skip-mlflow   # issue 21: one step per request
    .venv/bin/python bench/ingest.py --clients 16 --many-ranks --interval 2 --query-steps 0 --skip-mlflow \
        --tree orig=/tmp/qw-orig --tree new=. --rounds 2      # trees side by side, alternated, at a fixed cadence

``--tree NAME=PATH`` runs the collector from another checkout of the project (its ``quantwatch`` package first on
``PYTHONPATH``; the clients are this tree's), each on a fresh database; with several trees every backend runs each
tree in turn, ``--rounds`` times, and the summary gives each figure as a ratio to the first tree's in the same round.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
from _common import METRICS, postgres_database

from quantwatch.protocol import LAYER_METRICS
from quantwatch.service.server import free_port, wait_until_ready

LAYERS = [
    f"blocks.{i // 8}.{['attn.qkv', 'attn.out', 'mlp.fc1', 'mlp.fc2', 'norm1', 'norm2', 'gate', 'up'][i % 8]}"
    for i in range(512)
]


@contextmanager
def collector(database_url: str, tree: Path | None = None) -> Iterator[tuple[str, int]]:
    """A ``quantwatch serve`` on ``database_url``, run from the checkout ``tree`` (default: the installed package)."""
    port = free_port()
    cmd = [sys.executable, "-m", "quantwatch.cli", "serve", "--database-url", database_url, "--port", str(port)]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    # ``python -m`` puts its working directory first on sys.path, ahead of PYTHONPATH: start it in the tree, or the
    # checkout the benchmark runs from is what every "tree" runs.
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], env=env, cwd=tree)
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{port}/readyz", 120, "collector")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


HEALTHY_SCALE = 0.04  # below the shipped `output_rel_l2 > 0.05` rule: a healthy run
FLAPPING_SCALE = 1.0  # most layers cross that threshold back and forth every step: the alert engine's worst case


def workload_values(seed: int, scale: float) -> np.ndarray:
    """16 rows of per-layer figures, uniform in [0, scale)."""
    return np.random.default_rng(seed).random((16, len(LAYERS)), dtype=np.float32) * np.float32(scale)


def encode_batch(run: str, rank: int, steps: range, metrics: list[str], values: np.ndarray) -> bytes:
    """The agent's binary encoding: one float32 ``bin`` per metric and step."""
    blobs = [values[i % values.shape[0]].astype("<f4").tobytes() for i in range(len(metrics))]
    doc = {
        "run": run,
        "rank": rank,
        "batch_id": uuid.uuid4().hex,
        "layers": LAYERS,
        "steps": [
            {"step": s, "time": 1.7e9 + s, "metrics": {m: blobs[(j + s) % len(blobs)] for j, m in enumerate(metrics)}}
            for s in steps
        ],
    }
    return bytes(msgpack.packb(doc, use_bin_type=True))


# The "many ranks" workload (issue 21): each rank posts one sampled step per request, every SAMPLE_EVERY-th step,
# with 12 of the catalogue's per-layer metrics, as the agent does with its default sampling.
MANY_RANKS_METRICS = [m for m in LAYER_METRICS if m != "weight_drift_rel_l2"][:12]
SAMPLE_EVERY = 10


def ingest_client(
    args: tuple[str, str, int, int, float, float, Any, list[str], int, float],
) -> tuple[int, list[float], float, float]:
    """One client process: send batches back to back for ``seconds`` (encoding each takes ~1 ms, like the agent),
    or one every ``interval`` seconds (a fixed cadence, each client starting at a random phase) when it is > 0."""
    url, run, rank, steps_per_batch, seconds, scale, barrier, metrics, stride, interval = args
    values = workload_values(rank, scale)
    latencies: list[float] = []
    points = 0
    headers = {"Content-Type": "application/msgpack"}
    with httpx.Client(base_url=url, timeout=120) as http:
        barrier.wait()
        start = time.perf_counter()
        phase = np.random.default_rng(rank).random() * interval
        for i in range(10**9):
            if interval > 0:
                time.sleep(max(0.0, start + phase + i * interval - time.perf_counter()))
            steps = range(i * steps_per_batch * stride, (i + 1) * steps_per_batch * stride, stride)
            body = encode_batch(run, rank, steps, metrics, values)
            t0 = time.perf_counter()
            r = http.post("/api/v1/ingest", content=body, headers=headers)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            points += r.json()["points"]
            if time.perf_counter() - start >= seconds:
                break
        end = time.perf_counter()
    return points, latencies, start, end


def run_clients(
    url: str,
    run: str,
    clients: int,
    steps_per_batch: int,
    seconds: float,
    scale: float,
    metrics: list[str] = METRICS,
    stride: int = 1,
    interval: float = 0.0,
) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(clients)
        with ctx.Pool(clients) as pool:
            jobs = [
                (url, run, rank, steps_per_batch, seconds, scale, barrier, metrics, stride, interval)
                for rank in range(clients)
            ]
            results = pool.map(ingest_client, jobs)
    points = sum(r[0] for r in results)
    latencies = sorted(x for r in results for x in r[1])
    wall = max(r[3] for r in results) - min(r[2] for r in results)
    return {
        "points": points,
        "points_per_second": points / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "requests": len(latencies),
        "wall_seconds": wall,
    }


def fill_client(args: tuple[str, str, int, int, int]) -> float:
    url, run, first, last, per_batch = args
    values = workload_values(first, HEALTHY_SCALE)
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as http:
        for s in range(first, last, per_batch):
            body = encode_batch(run, 0, range(s, min(s + per_batch, last)), ["output_rel_l2"], values)
            http.post(
                "/api/v1/ingest", content=body, headers={"Content-Type": "application/msgpack"}
            ).raise_for_status()
    return time.perf_counter() - t0


def fill_and_query(url: str, steps: int, reps: int) -> dict[str, float]:
    """One run of ``steps`` steps × 512 layers of one metric, then timed heatmap and series queries."""
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    half = steps // 2 // 1000 * 1000
    # Two senders on one rank: one fills the first half of the steps, the other the second.
    with ctx.Pool(2) as pool:
        pool.map(fill_client, [(url, "bench-query", 0, half, 1000), (url, "bench-query", half, steps, 1000)])
    fill = time.perf_counter() - t0
    out: dict[str, float] = {"fill_points_per_second": steps * len(LAYERS) / fill}
    with httpx.Client(base_url=url, timeout=120) as http:
        queries = {
            "heatmap": ("/api/v1/runs/bench-query/heatmap", {"metric": "output_rel_l2", "max_steps": 500}),
            "series": (
                "/api/v1/runs/bench-query/series",
                {"metric": "output_rel_l2", "layer": LAYERS[300], "max_points": 1000},
            ),
        }
        for name, (path, params) in queries.items():
            r = http.get(path, params=params)
            r.raise_for_status()
            body = r.json()
            shape = (len(body["layers"]), len(body["steps"])) if name == "heatmap" else (len(body["steps"]),)
            times = []
            for _ in range(reps):
                q0 = time.perf_counter()
                http.get(path, params=params).raise_for_status()
                times.append(time.perf_counter() - q0)
            out[f"{name}_ms_p50"] = 1000 * statistics.median(times)
            out[f"{name}_ms_max"] = 1000 * max(times)
            out[f"{name}_shape"] = "×".join(map(str, shape))  # type: ignore[assignment]
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc): the collector's cost, which the load of
    other jobs on the machine moves far less than its throughput."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sqlite_bytes(path: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def postgres_bytes(url: str) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.connect() as conn:
        size = conn.execute(
            text(
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
            )
        ).scalar_one()
    engine.dispose()
    return int(size)


def bench_backend(name: str, url: str, size_of: Any, args: argparse.Namespace, tree: Path | None) -> dict[str, Any]:
    print(f"\n== {name}: {url}" + (f" (collector from {tree})" if tree is not None else ""), flush=True)
    with collector(url, tree) as (base, pid):
        cpu = process_cpu_seconds(pid)
        ingest = run_clients(
            base,
            "bench-ingest",
            args.clients,
            1 if args.many_ranks else args.steps_per_batch,
            args.seconds,
            FLAPPING_SCALE if args.flapping else HEALTHY_SCALE,
            MANY_RANKS_METRICS if args.many_ranks else METRICS,
            SAMPLE_EVERY if args.many_ranks else 1,
            args.interval,
        )
        ingest["cpu_ms_per_request"] = (process_cpu_seconds(pid) - cpu) * 1e3 / ingest["requests"]
        print(
            f"ingest: {ingest['points_per_second']:,.0f} points/s acknowledged "
            f"({ingest['points']:,} points in {ingest['requests']} requests, "
            f"{ingest['requests'] / ingest['wall_seconds']:.1f} requests/s, {ingest['wall_seconds']:.1f} s), "
            f"p50 {ingest['p50_ms']:.1f} ms, p99 {ingest['p99_ms']:.1f} ms, collector CPU "
            f"{ingest['cpu_ms_per_request']:.1f} ms per request; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        per_point = size_of() / ingest["points"]
        print(f"disk: {per_point:.2f} bytes per point (whole database incl. rollups and indexes)", flush=True)
        if args.query_steps <= 0:
            return {**ingest, "bytes_per_point": per_point}
        queries = fill_and_query(base, args.query_steps, args.reps)
        print(
            f"fill: {queries['fill_points_per_second']:,.0f} points/s with 1000-step batches; "
            f"heatmap {queries['heatmap_shape']} over {args.query_steps:,} steps: "
            f"p50 {queries['heatmap_ms_p50']:.1f} ms "
            f"(max {queries['heatmap_ms_max']:.1f}); series {queries['series_shape']} points: "
            f"p50 {queries['series_ms_p50']:.1f} ms (max {queries['series_ms_max']:.1f})",
            flush=True,
        )
    return {**ingest, "bytes_per_point": per_point, **queries}


MLFLOW_RETRIES = 7  # MLflow's own client: MLFLOW_HTTP_REQUEST_MAX_RETRIES, on 429 and 5xx, backoff factor 2


def mlflow_post(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """POST as MLflow's client does (retrying 429 and 5xx with exponential backoff); the answer and the retries."""
    for attempt in range(MLFLOW_RETRIES + 1):
        response = http.post(path, json=body)
        if response.status_code != 429 and response.status_code < 500:
            break
        time.sleep(min(0.1 * 2**attempt, 5.0))
    if response.is_error:
        # httpx's errors do not pickle: a worker must fail with a plain message, or Pool.map never returns.
        raise RuntimeError(f"MLflow {path}: {response.status_code} {response.text[:300]}")
    return response, attempt


def mlflow_client(args: tuple[str, int, float, Any]) -> tuple[int, float, float, int]:
    url, rank, seconds, barrier = args
    retries = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        run, _ = mlflow_post(http, "/api/2.0/mlflow/runs/create", {"experiment_id": "0", "run_name": f"bench-{rank}"})
        run_id = run.json()["run"]["info"]["run_id"]
        values = np.random.default_rng(rank).random((len(METRICS), len(LAYERS)), dtype=np.float32)
        barrier.wait()
        start = time.perf_counter()
        points = 0
        step = 0
        while time.perf_counter() - start < seconds:
            rows = [
                {"key": f"{layer}/{metric}", "value": float(values[j, i]), "timestamp": 1_700_000_000_000, "step": step}
                for j, metric in enumerate(METRICS)
                for i, layer in enumerate(LAYERS)
            ]
            for k in range(0, len(rows), 1000):  # log-batch accepts at most 1000 metrics per request
                _, retried = mlflow_post(
                    http, "/api/2.0/mlflow/runs/log-batch", {"run_id": run_id, "metrics": rows[k : k + 1000]}
                )
                retries += retried
                points += len(rows[k : k + 1000])
            step += 1
        return points, start, time.perf_counter(), retries


def bench_mlflow(args: argparse.Namespace, workdir: Path) -> float | None:
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    if mlflow is None:
        print("\nMLflow is not installed (pip install 'quantwatch[bench]'): skipping the comparison", flush=True)
        return None
    port = free_port()
    store = workdir / "mlflow.db"
    proc = subprocess.Popen(
        [
            mlflow,
            "server",
            "--backend-store-uri",
            f"sqlite:///{store}",
            "--default-artifact-root",
            str(workdir / "art"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{port}/health", 300, "mlflow")
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            barrier = manager.Barrier(args.clients)
            with ctx.Pool(args.clients) as pool:
                results = pool.map(
                    mlflow_client,
                    [(f"http://127.0.0.1:{port}", r, args.mlflow_seconds, barrier) for r in range(args.clients)],
                )
    finally:
        proc.terminate()
        proc.wait(30)
    points = sum(r[0] for r in results)
    rate = points / (max(r[2] for r in results) - min(r[1] for r in results))
    retries = sum(r[3] for r in results)
    print(
        f"\n== MLflow tracking server (SQLite, log-batch): {rate:,.0f} points/s acknowledged ({points:,} points, "
        f"{retries} requests retried after 429/5xx)",
        flush=True,
    )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20, help="ingest phase length per backend")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps-per-batch", type=int, default=16)
    parser.add_argument("--query-steps", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--mlflow-seconds", type=float, default=20)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--skip-mlflow", action="store_true")
    parser.add_argument(
        "--flapping", action="store_true", help="values in [0, 1): most layers cross the default 5%% rule every step"
    )
    parser.add_argument(
        "--many-ranks",
        action="store_true",
        help=f"each client a rank posting one sampled step (every {SAMPLE_EVERY}th) of 12 metrics per request",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds between one client's requests (a fixed cadence); 0: closed loop, back to back",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="run the collector from the checkout PATH (repeat to compare trees side by side; the first is the base)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="how many times each tree runs on each backend")
    args = parser.parse_args()
    trees: list[tuple[str, Path | None]] = [
        (name, Path(path)) for name, _, path in (spec.partition("=") for spec in args.tree)
    ] or [("this", None)]
    steps, metrics = (1, MANY_RANKS_METRICS) if args.many_ranks else (args.steps_per_batch, METRICS)
    cadence = f"one request per client every {args.interval:g} s" if args.interval > 0 else "closed loop"
    print(
        f"workload: {args.clients} client processes × batches of {steps} steps × {len(LAYERS)} layers × "
        f"{len(metrics)} metrics (msgpack float32 bin, {steps * len(LAYERS) * len(metrics):,} points/batch), "
        f"{cadence}, values uniform in [0, {FLAPPING_SCALE if args.flapping else HEALTHY_SCALE}) with the shipped "
        f"alert rules on; load average {os.getloadavg()[0]:.1f}"
    )
    results: list[tuple[str, int, str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="qw-bench-") as tmp:
        workdir = Path(tmp)
        backends = ["sqlite"] if args.skip_postgres else ["sqlite", "postgres"]
        for backend in backends:
            for round_ in range(args.rounds):
                for name, tree in trees:
                    label = f"{name} round {round_ + 1}"
                    if backend == "sqlite":
                        db = workdir / f"{name}-{round_}" / "quantwatch.db"
                        db.parent.mkdir()
                        result = bench_backend(
                            f"SQLite, {label}", f"sqlite:///{db}", partial(sqlite_bytes, db), args, tree
                        )
                    else:
                        with postgres_database(f"qw_bench_{name}_{round_}") as url:
                            result = bench_backend(
                                f"PostgreSQL, {label}", url, partial(postgres_bytes, url), args, tree
                            )
                    results.append((backend, round_, name, result))
        mlflow_rate = None if args.skip_mlflow else bench_mlflow(args, workdir)
    print_summary(results, mlflow_rate)


def print_summary(results: list[tuple[str, int, str, dict[str, Any]]], mlflow_rate: float | None) -> None:
    print("\n== summary (ratios: to the first tree of the same backend and round)")
    first = {(backend, round_): r for backend, round_, _, r in reversed(results)}
    for backend, round_, name, r in results:
        ratio = r["points_per_second"] / first[(backend, round_)]["points_per_second"]
        line = (
            f"{backend:9s} {name:>8s} r{round_ + 1} {r['points_per_second']:>11,.0f} points/s "
            f"{r['requests'] / r['wall_seconds']:7.1f} req/s ({ratio:.2f}×)  CPU {r['cpu_ms_per_request']:5.1f} ms/req"
            f"  p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:7.1f} ms  {r['bytes_per_point']:.2f} B/point"
        )
        if "heatmap_ms_p50" in r:
            line += f"  heatmap {r['heatmap_ms_p50']:.1f} ms  series {r['series_ms_p50']:.1f} ms"
        if mlflow_rate:
            line += f"  = {r['points_per_second'] / mlflow_rate:,.0f}× MLflow"
        print(line)
    if mlflow_rate:
        print(f"{'mlflow':9s} {mlflow_rate:>11,.0f} points/s")


if __name__ == "__main__":
    main()
