"""Bytes per point with retention on against off, side by side in one run (issue 21).

Fills a fresh database per case through the store (``Store.ingest`` in process) with bench/storage_layout.py's
batches (512 layers × 12 metrics, 16 consecutive steps per batch, recorded or random-walk values), once with
retention off and once keeping the newest ``--keep-steps`` raw steps, swept every ``--sweep-every`` batches as the
collector's background sweep would (``Store.sweep_retention``); each way with folding off and on. Prints the
database's bytes per point received (as storage_layout measures them: SQLite files after a checkpoint, PostgreSQL
``pg_total_relation_size``, with a ``VACUUM`` after every sweep, retention on or off, as autovacuum does in time: the
space of deleted rows is reused by the next ones but stays in the files) and the share of raw rows, chunks and
rollups, the ratio to retention off, and the store's ingest points/s by this process's CPU, the sweeps included.

Cases run one after the other in this process, on the checkout it imports (run it from an archived tree in /tmp).

    PYTHONPATH=. .venv/bin/python bench/retention.py --steps 4096 --keep-steps 512
    PYTHONPATH=. .venv/bin/python bench/retention.py --skip-postgres --workloads demo
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from _common import fresh_engine
from storage_layout import batches, database_size
from workloads import WORKLOADS


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """One case: fill a fresh database, sweeping when retention is on; measure it."""
    from quantwatch.service.batch import decode_msgpack
    from quantwatch.service.core.db import make_sessionmaker
    from quantwatch.service.store import RetentionPolicy, Store

    decoded = [decode_msgpack(b) for b in batches(case["workload"], 16, case["steps"] // 16, 1)]
    policy = RetentionPolicy(steps=case["keep"])
    with fresh_engine(case["backend"], "bench_retention") as engine:
        store = Store(engine, make_sessionmaker(engine), fold_chunks=case["fold"])
        points = dropped = 0
        cpu = time.process_time()
        for i, batch in enumerate(decoded, start=1):
            points += store.ingest(batch).points
            if i % case["sweep_every"] == 0:
                if case["keep"] is not None:
                    dropped += store.sweep_retention(policy, time.time()).points
                if case["backend"] == "postgres":  # what autovacuum does in time: deleted rows' space reusable
                    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                        conn.exec_driver_sql("VACUUM")
        cpu = time.process_time() - cpu
        store.wait_for_folds()  # the background folds of the last batches
        sizes = database_size(engine)
    return {
        "points": points,
        "dropped": dropped,
        "bytes_per_point": sizes["total"] / points,
        "shares": {t: sizes[t] / sizes["total"] for t in ("points", "point_chunks", "rollups")},
        "points_per_cpu_second": points / cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4096, help="steps ingested, in 16-step batches")
    parser.add_argument("--keep-steps", type=int, default=512, help="retention_steps of the retention-on cases")
    parser.add_argument("--sweep-every", type=int, default=16, help="batches between two sweeps")
    parser.add_argument("--workloads", nargs="*", default=["demo", "random-walk"], choices=list(WORKLOADS))
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at start; {args.steps} steps, keeping {args.keep_steps} raw")
    for backend in ["sqlite"] + ([] if args.skip_postgres else ["postgres"]):
        for workload in args.workloads:
            for fold in (False, True):
                case = {"backend": backend, "workload": workload, "fold": fold, "steps": args.steps}
                case["sweep_every"] = args.sweep_every
                off = measure({**case, "keep": None})
                on = measure({**case, "keep": args.keep_steps})
                for name, r in (("off", off), ("on", on)):
                    shares = " ".join(f"{t} {100 * s:4.1f}%" for t, s in r["shares"].items())
                    print(
                        f"{backend:8s} {workload:12s} fold {'on ' if fold else 'off'} retention {name:3s} "
                        f"{r['bytes_per_point']:6.2f} B/point ({r['bytes_per_point'] / off['bytes_per_point']:.2f}×; "
                        f"{shares}) dropped {r['dropped']:,} of {r['points']:,} points, "
                        f"{r['points_per_cpu_second']:,.0f} points/s by CPU "
                        f"({r['points_per_cpu_second'] / off['points_per_cpu_second']:.2f}×)",
                        flush=True,
                    )
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
