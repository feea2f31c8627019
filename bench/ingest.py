"""Collector ingest and query benchmark (issues 3 and 21), side by side with an MLflow tracking server.

Starts a real ``quantwatch serve`` (uvicorn on loopback) on SQLite, then on PostgreSQL, and drives it from one client
process per rank (bench/_clients.py: keep-alive HTTP, bodies from blobs made once) sending the agent's binary encoding
(msgpack, float32 ``bin`` per metric) of 512 layers × 8 metrics per step. Prints acknowledged points/s (each 200 means
committed), p50/p99 request latency, the collectors' CPU per request, the cores the collectors, the clients,
PostgreSQL and the whole machine used, bytes per point on disk, and the run's alert episodes by (rule, layer) through
the REST API; then fills one run with 100,000 steps × 512 layers and times a 512 × 500 heatmap and a 1,000-point
series. Finally sends the same workload through MLflow's ``log-batch`` REST endpoint (if MLflow is installed).

    .venv/bin/python bench/ingest.py                 # everything (several minutes)
    .venv/bin/python bench/ingest.py --seconds 10 --skip-postgres --query-steps 20000

Issue 21's "many ranks" set (``--many-ranks``: each rank one sampled step, every 25th, of 512 layers × 12 metrics per
request; the values make two shipped rules fire on every layer), 16 and 64 ranks, closed loop and at the agent's flush
interval, SQLite, PostgreSQL and two collector replicas on one PostgreSQL database (rank r posts to replica r % 2),
the tree before issue 21 against main: 24 runs, 8 minutes at load 7–15 on 2 cores (13 with ``--seconds 10``;
``--seconds`` sets each run's window):

    cd /tmp && PYTHONPATH=/path/to/checkout .venv/bin/python /path/to/checkout/bench/ingest.py --many-ranks \\
        --clients 16,64 --interval 0,2 --replicas 1,2 --seconds 8 --query-steps 0 --skip-mlflow \\
        --tree orig=/tmp/qw-orig --tree main=/tmp/qw-main

Issue 21's ratio of batch sizes, side by side (each tree runs the 1-step and the 16-step workload one after the other
in every round; the last table gives 1-step ÷ 16-step points/s per tree and round), with the agent's scalars:

    .venv/bin/python bench/ingest.py --clients 8 --steps-per-batch 1,16 --every 25 --scalars --rounds 2 \
        --seconds 12 --query-steps 0 --skip-mlflow

``--tree NAME=PATH`` runs the collector from another checkout of the project (``git archive`` it into /tmp; its
``quantwatch`` package first on ``PYTHONPATH``, the collector started in it; the clients are this tree's), each on a
fresh database; start the bench outside any checkout (``python -m`` puts the working directory first on
``sys.path``). Every case (backend × replicas × ranks × interval) runs each tree in turn, ``--rounds`` times, and the
summary's Markdown rows give each figure with its ratio to the first tree's in the same case and round. Each rank sends
``--warmup`` batches' steps in one request before the measured window, so the rules' episodes are open when it
starts.
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
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _clients import batch_body, run_clients
from _common import METRICS, postgres_database

from quantwatch.protocol import LAYER_METRICS, SCALARS
from quantwatch.service.server import free_port, wait_until_ready

LAYERS = [
    f"blocks.{i // 8}.{['attn.qkv', 'attn.out', 'mlp.fc1', 'mlp.fc2', 'norm1', 'norm2', 'gate', 'up'][i % 8]}"
    for i in range(512)
]


@contextmanager
def collectors(database_url: str, tree: Path | None = None, count: int = 1) -> Iterator[list[tuple[str, int]]]:
    """``count`` replicas of ``quantwatch serve`` on ``database_url`` (started together: the migrations take an
    advisory lock), run from the checkout ``tree`` (default: the installed package); their (URL, pid)."""
    ports = [free_port() for _ in range(count)]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    # ``python -m`` puts its working directory first on sys.path, ahead of PYTHONPATH: start it in the tree, or the
    # checkout the benchmark runs from is what every "tree" runs.
    serve = [sys.executable, "-m", "quantwatch.cli", "serve", "--database-url", database_url, "--log-level", "warning"]
    procs = [subprocess.Popen([*serve, "--port", str(port)], env=env, cwd=tree) for port in ports]
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_until_ready(proc, f"http://127.0.0.1:{port}/readyz", 120, "collector")
        yield [(f"http://127.0.0.1:{port}", proc.pid) for proc, port in zip(procs, ports, strict=True)]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


@contextmanager
def scraping(urls: list[str], every: float) -> Iterator[list[int]]:
    """GET every collector's /metrics at once and then every ``every`` seconds while the block runs, as Prometheus
    does (the exposition merges and renders in the background only while someone scrapes); yields the count of
    scrapes so far. ``every`` 0: no scrapes."""
    done = [0]
    if every <= 0:
        yield done
        return
    stop, failed = threading.Event(), []

    def loop() -> None:
        with httpx.Client(timeout=60) as http:
            while True:
                try:
                    for url in urls:
                        http.get(f"{url}/metrics").raise_for_status()
                except httpx.HTTPError as exc:
                    failed.append(exc)
                    return
                done[0] += 1
                if stop.wait(every):
                    return

    thread = threading.Thread(target=loop, name="scraper", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join()
    if failed:
        raise RuntimeError(f"a scrape failed: {failed[0]!r}")


RUN = "bench-ingest"
HEALTHY_SCALE = 0.04  # below the shipped `output_rel_l2 > 0.05` rule: a healthy run
FLAPPING_SCALE = 1.0  # most layers cross that threshold back and forth every step: the alert engine's worst case


def workload_values(seed: int, scale: float) -> np.ndarray:
    """16 rows of per-layer figures, uniform in [0, scale)."""
    return np.random.default_rng(seed).random((16, len(LAYERS)), dtype=np.float32) * np.float32(scale)


def work_spec(
    run: str,
    rank: int,
    metrics: list[str],
    values: np.ndarray,
    steps: int,
    stride: int = 1,
    interval: float = 0.0,
    scalars: bool = False,
) -> dict[str, Any]:
    """What one rank's client makes its bodies from (:func:`_clients.batch_body`): batches of ``steps`` steps
    ``stride`` apart, metric ``i`` a float32 ``bin`` of row ``i % 16`` of ``values`` (rotated by step); with
    ``scalars``, every step carries the catalogue's per-run scalars too (loss, step_seconds, …, as the agent's do)."""
    blobs = [values[i % values.shape[0]].astype("<f4").tobytes() for i in range(len(metrics))]
    spec = {"run": run, "rank": rank, "layers": LAYERS, "metrics": metrics, "blobs": blobs}
    spec["scalars"] = list(SCALARS) if scalars else []
    return spec | {"steps_per_batch": steps, "stride": stride, "interval": interval}


def encode_batch(
    run: str, rank: int, steps: range, metrics: list[str], values: np.ndarray, *, scalars: bool = False
) -> bytes:
    """The agent's binary encoding: one float32 ``bin`` per metric and step (and the scalars: see work_spec)."""
    return batch_body(work_spec(run, rank, metrics, values, len(steps), steps.step, scalars=scalars), steps.start)


# The "many ranks" workload (issue 21): each rank posts one sampled step per request, every SAMPLE_EVERY-th step,
# with 12 of the catalogue's per-layer metrics, as the agent does with its default sampling.
MANY_RANKS_METRICS = [m for m in LAYER_METRICS if m != "weight_drift_rel_l2"][:12]
SAMPLE_EVERY = 25  # the agent's default sampling period (``every``)


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


@dataclass(frozen=True)
class Case:
    """One ingest configuration: where it is stored and how the ranks send."""

    backend: str
    replicas: int
    clients: int
    interval: float
    steps: int

    def __str__(self) -> str:
        cadence = f"every {self.interval:g} s" if self.interval > 0 else "closed loop"
        return f"{self.backend} ×{self.replicas}, {self.clients} ranks, {cadence}, {self.steps}-step"


def check_episodes(url: str, run: str) -> dict[str, Any]:
    """The alert episodes of ``run`` by (rule, layer), through the REST API: a layer firing in several ranks, on
    any replica, must make one episode (``duplicated``: keys with more than one open episode)."""
    episodes = httpx.get(f"{url}/api/v1/alerts", params={"run": run, "limit": 10_000}, timeout=120).json()
    open_ = Counter((e["rule"], e["layer"]) for e in episodes if e["state"] != "resolved")
    ranks = [len(e["ranks"]) for e in episodes]
    return {
        "episodes": len(episodes),
        "layers": len({e["layer"] for e in episodes}),
        "rules": len({e["rule"] for e in episodes}),
        "duplicated": sum(n > 1 for n in open_.values()),
        "resolved": sum(e["state"] == "resolved" for e in episodes),
        "ranks": (min(ranks, default=0), max(ranks, default=0)),
    }


def bench_backend(
    title: str, url: str, size_of: Any, args: argparse.Namespace, tree: Path | None, case: Case
) -> dict[str, Any]:
    print(f"\n== {title}: {url}" + (f" (collector from {tree})" if tree is not None else ""), flush=True)
    began = time.monotonic()
    with collectors(url, tree, case.replicas) as replicas:
        ready = time.monotonic() - began
        metrics = MANY_RANKS_METRICS if args.many_ranks else METRICS
        scale = FLAPPING_SCALE if args.flapping else HEALTHY_SCALE
        works = [
            work_spec(
                RUN,
                rank,
                metrics,
                workload_values(rank, scale),
                case.steps,
                args.every,
                case.interval,
                args.scalars,
            )
            for rank in range(case.clients)
        ]
        urls, pids = [base for base, _ in replicas], [pid for _, pid in replicas]
        with scraping(urls, args.scrape) as scrapes:
            ingest = run_clients(urls, works, args.seconds, args.warmup, pids)
        ingest["scrapes"] = scrapes[0]
        ingest["episodes"] = check_episodes(replicas[-1][0], RUN)
        shares = ", ".join(f"{k} {ingest[k + '_cores']:.2f}" for k in ("collector", "client", "postgres", "machine"))
        print(
            f"ingest: {ingest['points_per_second']:,.0f} points/s acknowledged "
            f"({ingest['points']:,} points in {ingest['requests']} requests, "
            f"{ingest['requests'] / ingest['wall_seconds']:.1f} requests/s, {ingest['wall_seconds']:.1f} s), "
            f"p50 {ingest['p50_ms']:.1f} ms, p99 {ingest['p99_ms']:.1f} ms, collector CPU "
            f"{ingest['cpu_ms_per_request']:.1f} ms per request, {ingest['refused']} refused (429), "
            f"{ingest['late']} sent a period late (most behind its time: {ingest['lag_seconds']:.2f} s); cores used: "
            f"{shares}; load average {os.getloadavg()[0]:.1f}; collectors ready in {ready:.0f} s, clients spawned "
            f"and warmed up in {ingest['setup_seconds']:.0f} s; {ingest['scrapes']} scrapes of /metrics\n"
            f"episodes: {ingest['episodes']}",
            flush=True,
        )
        per_point = size_of() / ingest["points"]
        print(
            f"disk: {per_point:.2f} bytes per point (whole database incl. rollups and indexes); "
            f"{time.monotonic() - began:.0f} s since the collector started",
            flush=True,
        )
        if args.query_steps <= 0:
            return {**ingest, "bytes_per_point": per_point}
        queries = fill_and_query(replicas[0][0], args.query_steps, args.reps)
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
            barrier = manager.Barrier(args.clients[0])
            with ctx.Pool(args.clients[0]) as pool:
                results = pool.map(
                    mlflow_client,
                    [(f"http://127.0.0.1:{port}", r, args.mlflow_seconds, barrier) for r in range(args.clients[0])],
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


def numbers(kind: type, text: str) -> list[Any]:
    """A comma-separated list of ``kind`` (``--clients 16,64``)."""
    return [kind(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20, help="ingest phase length per case")
    parser.add_argument(
        "--clients", type=partial(numbers, int), default=[4], help="client processes (ranks), a list: 16,64"
    )
    parser.add_argument(
        "--steps-per-batch",
        type=partial(numbers, int),
        help="steps a request, a list: 1,16 runs both workloads in turn in every round and prints their points/s "
        "ratio (issue 21's goal) for each tree and round; default 16, 1 with --many-ranks",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="batches' steps each rank sends in one request before the measured window (the shipped rules fire "
        "after 3 steps)",
    )
    parser.add_argument("--query-steps", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--mlflow-seconds", type=float, default=20)
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--skip-mlflow", action="store_true")
    parser.add_argument(
        "--flapping", action="store_true", help="values in [0, 1): most layers cross the default 5%% rule every step"
    )
    parser.add_argument(
        "--many-ranks",
        action="store_true",
        help="each client a rank posting one sampled step of 12 metrics per request (as with --steps-per-batch 1)",
    )
    parser.add_argument(
        "--scalars",
        action="store_true",
        help="every step also carries the catalogue's per-run scalars (loss, step_seconds, ...), as the agent's do",
    )
    parser.add_argument(
        "--every",
        type=int,
        help=f"steps between two sampled steps: default {SAMPLE_EVERY} (the agent's) with --many-ranks, else 1",
    )
    parser.add_argument(
        "--interval",
        type=partial(numbers, float),
        default=[0.0],
        help="seconds between one client's requests (a fixed cadence), a list: 0,2; 0: closed loop, back to back",
    )
    parser.add_argument(
        "--replicas",
        type=partial(numbers, int),
        default=[1],
        help="collector processes on one PostgreSQL database, a list: 1,2 (ranks alternate between them)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="run the collector from the checkout PATH (repeat to compare trees side by side; the first is the base)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="how many times each tree runs each case")
    parser.add_argument(
        "--scrape",
        type=float,
        default=0.0,
        help="seconds between two scrapes of every collector's /metrics while the clients run, as Prometheus's "
        "(dashboards/prometheus/prometheus.yml: 5); 0 (default): none, and the exposition merges nothing",
    )
    args = parser.parse_args()
    if args.steps_per_batch is None:
        args.steps_per_batch = [1] if args.many_ranks else [16]
    if args.every is None:
        args.every = SAMPLE_EVERY if args.many_ranks else 1
    return args


def main() -> None:
    args = parse_args()
    trees: list[tuple[str, Path | None]] = [
        (name, Path(path)) for name, _, path in (spec.partition("=") for spec in args.tree)
    ] or [("this", None)]
    metrics = MANY_RANKS_METRICS if args.many_ranks else METRICS
    steps = args.steps_per_batch
    print(
        f"workload: {args.clients} client processes (ranks) × batches of {steps} steps (every {args.every}th) × "
        f"{len(LAYERS)} layers × "
        f"{len(metrics)} metrics (msgpack float32 bin, {[n * len(LAYERS) * len(metrics) for n in steps]} "
        "points/batch)"
        f"{f' + {len(SCALARS)} scalars a step' if args.scalars else ''}, "
        f"requests every {args.interval} s (0: closed loop), values uniform in "
        f"[0, {FLAPPING_SCALE if args.flapping else HEALTHY_SCALE}) with the shipped alert rules on; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    backends = [b for b, skip in (("sqlite", args.skip_sqlite), ("postgres", args.skip_postgres)) if not skip]
    settings = [
        (backend, replicas, clients, interval)
        for backend in backends
        for replicas in (args.replicas if backend == "postgres" else [1])
        for clients in args.clients
        for interval in args.interval
    ]
    results: list[tuple[Case, int, str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="qw-bench-") as tmp:
        workdir = Path(tmp)
        for n, setting in enumerate(settings):
            for round_ in range(args.rounds):
                # The batch sizes run one after the other for each tree: their ratio is measured side by side.
                for (name, tree), steps_per_batch in ((t, s) for t in trees for s in args.steps_per_batch):
                    case = Case(*setting, steps_per_batch)
                    title = f"{case}, {name} round {round_ + 1}"
                    if case.backend == "sqlite":
                        db = workdir / f"{name}-{n}-{round_}-{steps_per_batch}" / "quantwatch.db"
                        db.parent.mkdir()
                        result = bench_backend(title, f"sqlite:///{db}", partial(sqlite_bytes, db), args, tree, case)
                    else:
                        with postgres_database(f"qw_bench_{name}_{n}_{round_}_{steps_per_batch}") as url:
                            result = bench_backend(title, url, partial(postgres_bytes, url), args, tree, case)
                    results.append((case, round_, name, result))
        mlflow_rate = None if args.skip_mlflow else bench_mlflow(args, workdir)
    print_summary(results, mlflow_rate)


def print_summary(results: list[tuple[Case, int, str, dict[str, Any]]], mlflow_rate: float | None) -> None:
    """One Markdown row per run: requests/s (× the first tree's in the same case and round), points/s, latency,
    the collectors' CPU per request, bytes/point, the cores each part used and the episode check."""
    print(
        "\n== summary (× : to the first tree of the same case and round; cores: collectors / clients / PostgreSQL "
        "/ the whole machine, of 2)\n"
        "| case | tree | req/s (offered, most behind) | × | points/s | p50 ms | p99 ms | CPU ms/req | B/point | cores "
        "| episodes |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    first = {(case, round_): r for case, round_, _, r in reversed(results)}
    for case, round_, name, r in results:
        rate = r["requests"] / r["wall_seconds"]
        offered = f" ({case.clients / case.interval:g}, lag {r['lag_seconds']:.1f} s)" if case.interval > 0 else ""
        ratio = r["points_per_second"] / first[(case, round_)]["points_per_second"]
        cores = " / ".join(f"{r[k + '_cores']:.2f}" for k in ("collector", "client", "postgres", "machine"))
        e = r["episodes"]
        episodes = (
            f"{e['episodes']} on {e['layers']} layers × {e['rules']} rules, {e['duplicated']} duplicated, "
            f"{e['resolved']} resolved, ranks {e['ranks'][0]}–{e['ranks'][1]}"
        )
        line = (
            f"| {case} | {name} r{round_ + 1} | {rate:.1f}{offered} | {ratio:.2f} | {r['points_per_second']:,.0f} | "
            f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['cpu_ms_per_request']:.1f} | {r['bytes_per_point']:.2f} | "
            f"{cores} | {episodes} |"
        )
        if "heatmap_ms_p50" in r:
            line += f" heatmap {r['heatmap_ms_p50']:.1f} ms, series {r['series_ms_p50']:.1f} ms |"
        if mlflow_rate:
            line += f" {r['points_per_second'] / mlflow_rate:,.0f}× MLflow |"
        print(line)
    if mlflow_rate:
        print(f"MLflow: {mlflow_rate:,.0f} points/s")
    print_batch_ratios(results)


def print_batch_ratios(results: list[tuple[Case, int, str, dict[str, Any]]]) -> None:
    """With several batch sizes: each tree's points/s with the smallest batches ÷ with the largest, per setting and
    round (issue 21's goal: 1-step ≥ 0.5 × 16-step), and the CPU a request of each."""
    sizes = sorted({case.steps for case, *_ in results})
    if len(sizes) < 2:
        return
    small, large = sizes[0], sizes[-1]
    runs: dict[tuple[Case, int, str], dict[int, dict[str, Any]]] = {
        (replace(case, steps=0), round_, name): {} for case, round_, name, _ in results
    }
    for case, round_, name, r in results:
        runs[(replace(case, steps=0), round_, name)][case.steps] = r
    print(f"\n== {small}-step ÷ {large}-step points/s, same tree and round\n| case | tree | ratio | CPU ms/req |")
    print("|---|---|---|---|")
    for (case, round_, name), by_size in runs.items():
        ratio = by_size[small]["points_per_second"] / by_size[large]["points_per_second"]
        cpu = " / ".join(f"{by_size[n]['cpu_ms_per_request']:.2f}" for n in (small, large))
        setting = str(case).rsplit(", ", 1)[0]
        print(f"| {setting} | {name} r{round_ + 1} | {ratio:.3f} | {cpu} |")


if __name__ == "__main__":
    main()
