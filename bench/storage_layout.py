"""Bytes per point of the collector's store on realistic values, before and after (issue 21).

Ingests the same batches through the store (``Store.ingest``, in process: what a request costs the store, without
HTTP) into a fresh database per case: 512 layers × 12 metrics, either 16-step batches of consecutive steps, or
1-step batches of every 10th step (the agent's sampling, as bench/ingest.py ``--many-ranks`` sends them). Values
come from bench/workloads.py: the demo's and the agent benchmark's recorded series replayed at scale, a random walk,
and uniform random numbers (incompressible, the bound). Prints bytes per point of the whole database, the share of
the raw points, chunks and rollups in it, and the bytes per point the second half of the batches added: the raw tail
waiting to be folded and the space its deleted rows free for the next ones stay about the same size however long the
run, so this is the cost per point of a long run. Then ingest points/s (16-step) or requests/s (1-step) by CPU and
wall time, and, after the 16-step fill, heatmap and series reads (median CPU milliseconds).

Both sizes are taken in a steady state, once the store's background folds are done (``Store.wait_for_folds``).
SQLite: the files after a checkpoint, less their free pages. PostgreSQL: ``pg_total_relation_size`` of every table
(heap, TOAST, indexes, free space map and visibility map) after a ``VACUUM``, so the rows the folds deleted count as
the free space they leave for the next raw rows, not as dead tuples whose count depends on when autovacuum last ran;
and the fill waits for the folds after each batch (its clocks stopped meanwhile), as they keep up in a collector its
agents do not saturate: a table never shrinks below its last live row, so a fill at full speed measured how far the
folds fell behind it (the raw table held up to every row of the run), which moved with the machine's load. On
PostgreSQL a line per case then breaks the whole database down by table (the raw points, chunks, rollups, the rest):
heap, TOAST and index bytes per point, and the raw table's live, dead and free bytes (``pgstattuple`` when the
extension can be created, else ``pg_stat_user_tables``' tuple counts). The CPU rates count this process only: not the
fold worker's encoding process, nor, on PostgreSQL, the folds between batches.

Each ``--tree NAME=PATH`` runs the store of another checkout (its package first on ``PYTHONPATH``), the trees
alternated case by case; ratios are to the first tree's. ``NAME=PATH,fold`` builds that tree's store with folding on
and ``NAME=PATH,raw`` with it off (the collector's ``fold_chunks`` setting; on by default since the folds run in the
background, opt-in before), so one checkout can run both ways side by side.

    .venv/bin/python bench/storage_layout.py --tree main=/tmp/qw-main --tree new=. --tree raw=.,raw
    .venv/bin/python bench/storage_layout.py --skip-postgres --workloads demo --steps 256 --requests 200
    .venv/bin/python bench/storage_layout.py --skip-sqlite --steps 4096 --requests 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
from _common import fresh_engine
from workloads import WORKLOADS

from quantwatch.protocol import LAYER_METRICS

LAYERS = [f"blocks.{i // 8}.l{i % 8}" for i in range(512)]
METRICS = [m for m in LAYER_METRICS if m != "weight_drift_rel_l2"][:12]
SAMPLE_EVERY = 10
READ_REPS = 15


def batches(workload: str, steps_per_batch: int, count: int, stride: int) -> list[bytes]:
    """The agent's binary encoding of ``count`` batches (float32 ``bin`` per metric and step)."""
    values = WORKLOADS[workload](len(LAYERS), len(METRICS))
    out = []
    for b in range(count):
        steps = [(b * steps_per_batch + i) * stride for i in range(steps_per_batch)]
        doc = {
            "run": "bench",
            "rank": 0,
            "batch_id": uuid.uuid4().hex,
            "layers": LAYERS,
            "steps": [
                {
                    "step": s,
                    "time": 1.7e9 + s,
                    "metrics": {m: values(j, s).astype("<f4").tobytes() for j, m in enumerate(METRICS)},
                }
                for s in steps
            ],
        }
        out.append(bytes(msgpack.packb(doc, use_bin_type=True)))
    return out


TABLES = ("points", "point_chunks", "rollups")


def database_size(engine: Any) -> dict[str, Any]:
    """Bytes of the whole database and of its point, chunk and rollup tables (with their indexes); on PostgreSQL
    also ``tables``, each of those tables' (and the rest's) heap, TOAST, index and other bytes (free space map,
    visibility map), and ``raw``, the raw points' heap tuples: live, dead, free (bytes, or tuple counts from the
    statistics collector where ``pgstattuple`` cannot be created)."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            tables = dict(conn.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")).all())
            path = Path(engine.url.database)
            # The pages in use: a file never shrinks, and the pages of raw rows folded away wait on the freelist
            # for the next rows (a background fold deletes them after a peak the file keeps the size of).
            free = conn.exec_driver_sql("PRAGMA freelist_count").scalar_one()
            page = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
            total = sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) - int(free) * int(page)
            index = {"points": ["ix_points_key"], "point_chunks": ["ix_point_chunks_key"], "rollups": []}
            parts = {t: int(tables.get(t, 0)) + sum(int(tables.get(i, 0)) for i in index[t]) for t in index}
            return {"total": total, **parts}
        rows = conn.execute(
            text(
                "SELECT c.relname, pg_total_relation_size(c.oid), pg_relation_size(c.oid), "
                "coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0), pg_indexes_size(c.oid) "
                "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind = 'r'"
            )
        ).all()
        sizes = {str(r[0]): int(r[1]) for r in rows}
        split: dict[str, dict[str, int]] = {t: dict.fromkeys(("heap", "toast", "indexes", "other"), 0) for t in TABLES}
        split["rest"] = dict.fromkeys(("heap", "toast", "indexes", "other"), 0)
        for name, whole, heap, toast, indexes in rows:
            into = split[name if name in TABLES else "rest"]
            for key, value in (("heap", heap), ("toast", toast), ("indexes", indexes)):
                into[key] += int(value)
            into["other"] += int(whole) - int(heap) - int(toast) - int(indexes)
        try:
            with conn.begin_nested():
                conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pgstattuple")
            live, dead, free = conn.execute(
                text("SELECT tuple_len, dead_tuple_len, free_space FROM pgstattuple('points')")
            ).one()
            raw = {"unit": "bytes", "live": int(live), "dead": int(dead), "free": int(free)}
        except DBAPIError:  # no contrib package, or no right to create it: the tuple counts the server keeps
            live, dead = conn.execute(
                text("SELECT n_live_tup, n_dead_tup FROM pg_stat_user_tables WHERE relname = 'points'")
            ).one()
            raw = {"unit": "tuples", "live": int(live), "dead": int(dead), "free": 0}
    total = sum(sizes.values())
    return {"total": total, **{t: sizes.get(t, 0) for t in TABLES}, "tables": split, "raw": raw}


def settle(store: Any) -> None:
    """Wait for the store's background folds (trees before they ran in the background fold as they ingest)."""
    wait = getattr(store, "wait_for_folds", None)
    if wait is not None:
        wait()


def steady_size(store: Any, engine: Any) -> dict[str, Any]:
    """:func:`database_size` once the folds are done and, on PostgreSQL, after a ``VACUUM`` (see the module)."""
    settle(store)
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM")
    return database_size(engine)


def worker(case: dict[str, Any]) -> dict[str, Any]:
    """One case in this process: fill a fresh database, measure it."""
    from quantwatch.service.batch import decode_msgpack
    from quantwatch.service.core.db import make_sessionmaker
    from quantwatch.service.store import Store

    one_step = case["batch"] == 1
    count = case["requests"] if one_step else case["steps"] // 16
    bodies = batches(case["workload"], case["batch"], count, SAMPLE_EVERY if one_step else 1)
    decoded = [decode_msgpack(b) for b in bodies]
    paced = case["backend"] == "postgres"
    with fresh_engine(case["backend"], "bench_storage") as engine:
        store = Store(
            engine, make_sessionmaker(engine), **({} if case["fold"] is None else {"fold_chunks": case["fold"]})
        )
        clocks = {"points": 0, "cpu": 0.0, "wall": 0.0}

        def fill(part: list[Any]) -> None:
            for batch in part:
                cpu, wall = time.process_time(), time.perf_counter()
                clocks["points"] += store.ingest(batch).points
                clocks["cpu"] += time.process_time() - cpu
                clocks["wall"] += time.perf_counter() - wall
                if paced:  # the folds keep up (see the module), off the clocks
                    settle(store)

        half = len(decoded) // 2
        fill(decoded[:half])
        first = clocks["points"]
        before = steady_size(store, engine)
        fill(decoded[half:])
        points = clocks["points"]
        sizes = steady_size(store, engine)
        out: dict[str, Any] = {
            "points": points,
            "bytes_per_point": sizes["total"] / points,
            "shares": {t: sizes[t] / sizes["total"] for t in TABLES},
            # What the second half added per point: the raw tail waiting to be folded and the space its deleted rows
            # leave stay about the same size however long the run, so this is what a long run costs per point.
            "marginal_bytes_per_point": (sizes["total"] - before["total"]) / (points - first),
            "rate_cpu": (count if one_step else points) / clocks["cpu"],
            "rate_wall": (count if one_step else points) / clocks["wall"],
        }
        if "tables" in sizes:
            out["tables"] = {t: {k: v / points for k, v in parts.items()} for t, parts in sizes["tables"].items()}
            out["raw"] = sizes["raw"]
        if not one_step:
            reads = {
                "heatmap 512×500": lambda: store.heatmap("bench", METRICS[0], 0, None, None, 500, None, "max"),
                "series exact": lambda: store.series("bench", METRICS[0], LAYERS[300], 0, None, None, 100_000),
                "series 200 pts": lambda: store.series("bench", METRICS[0], LAYERS[300], 0, None, None, 200),
            }
            out["reads_ms"] = {}
            for name, read in reads.items():
                read()
                times = []
                for _ in range(READ_REPS):
                    # CPU time: on a shared machine it moves far less than wall time (on PostgreSQL it leaves out
                    # the server's share, the same statements in both trees but for the chunks' reads).
                    t0 = time.process_time()
                    read()
                    times.append((time.process_time() - t0) * 1e3)
                out["reads_ms"][name] = statistics.median(times)
    return out


def breakdown(result: dict[str, Any]) -> str:
    """The PostgreSQL tables' bytes per point (heap/TOAST/indexes/FSM and VM) and the raw points' tuples."""
    parts = ", ".join(f"{t} " + "/".join(f"{v:.2f}" for v in split.values()) for t, split in result["tables"].items())
    raw = result["raw"]
    if raw["unit"] == "bytes":
        tuples = f"live {raw['live'] / 1e6:.1f} MB, dead {raw['dead'] / 1e6:.1f} MB, free {raw['free'] / 1e6:.1f} MB"
    else:
        tuples = f"live {raw['live']} tuples, dead {raw['dead']} tuples"
    return f"    B/point heap/TOAST/indexes/FSM+VM: {parts}; raw points' heap: {tuples}"


def run_case(tree: Path, case: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), str(Path(__file__).parent)])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(case)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"{tree} {case}: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def tree_spec(spec: str) -> tuple[Path, bool | None]:
    """``PATH``, ``PATH,fold`` or ``PATH,raw``: the checkout and whether its store folds (None: its default)."""
    path, _, option = spec.partition(",")
    if option not in ("", "fold", "raw"):
        raise SystemExit(f"--tree: unknown option {option!r} after {path!r} (accepted: fold, raw)")
    return Path(path), {"": None, "fold": True, "raw": False}[option]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1024, help="steps of the 16-step-batch fill")
    parser.add_argument("--requests", type=int, default=1000, help="1-step batches (every 10th step)")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH (default: this checkout)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    trees = [(n, *tree_spec(p)) for n, p in (t.split("=", 1) for t in args.tree)] or [("this", Path.cwd(), None)]
    backends = ([] if args.skip_sqlite else ["sqlite"]) + ([] if args.skip_postgres else ["postgres"])
    print(f"load average {os.getloadavg()[0]:.1f} at start; {len(LAYERS)} layers × {len(METRICS)} metrics")
    for backend in backends:
        for batch in (16, 1):
            for workload in args.workloads:
                case = {"backend": backend, "batch": batch, "workload": workload}
                case |= {"steps": args.steps, "requests": args.requests}
                results = [(name, run_case(tree, {**case, "fold": fold})) for name, tree, fold in trees]
                base = results[0][1]
                for name, r in results:
                    unit = "requests/s" if batch == 1 else "points/s"
                    shares = " ".join(f"{t} {100 * s:4.1f}%" for t, s in r["shares"].items())
                    line = (
                        f"{backend:8s} {batch:2d}-step {workload:24s} {name:6s} {r['bytes_per_point']:6.2f} B/point "
                        f"({r['bytes_per_point'] / base['bytes_per_point']:.2f}×; {shares}), second half "
                        f"{r['marginal_bytes_per_point']:.2f} B/point "
                        f"({r['marginal_bytes_per_point'] / base['marginal_bytes_per_point']:.2f}×)  "
                        f"{r['rate_cpu']:,.0f} {unit} by CPU ({r['rate_cpu'] / base['rate_cpu']:.2f}×), "
                        f"{r['rate_wall']:,.0f} by wall ({r['rate_wall'] / base['rate_wall']:.2f}×)"
                    )
                    if "reads_ms" in r:
                        line += "  reads " + ", ".join(
                            f"{k} {v:.1f} ms ({v / base['reads_ms'][k]:.2f}×)" for k, v in r["reads_ms"].items()
                        )
                    print(line, flush=True)
                    if "tables" in r:
                        print(breakdown(r), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
