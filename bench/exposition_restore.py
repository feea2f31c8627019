"""The start-up restore of the exposition (issue 20): seconds to rebuild /metrics from a database of realistic size.

    .venv/bin/python bench/exposition_restore.py [--backend sqlite|postgres] [--runs 100] [--ranks 2] [--layers 512]
        [--steps 100] [--repeat 3]

Builds a database through the collector's own ingest path (store + alert engine): ``--runs`` runs of ``--ranks``
ranks, ``--layers`` layers, the 8 per-layer metrics every step and ``update_cosine`` every 10th step (so the
restore has to look back for it), 4 scalars, batches of 4 steps, and a rule that fires on 5% of the layers. Then it
times :meth:`StartupRestore.restore` into a fresh cache ``--repeat`` times (wall and process CPU), compares the
restored layer, scalar, last-step, streak and state lines with the ingesting collector's own, series by series, and
prints the database size and the peak Python memory the restore allocated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import numpy as np
from _common import METRICS, postgres_database
from prometheus_client import CollectorRegistry
from sqlalchemy import text

import quantwatch
from quantwatch.service import Settings, create_app
from quantwatch.service.batch import IngestBatch, IngestStep
from quantwatch.service.exposition import LatestValueCache, QuantWatchCollector, StartupRestore, render_exposition
from quantwatch.service.exposition.alert_states import alert_series_source

COMPARED = (
    "quantwatch_layer_",
    "quantwatch_run_loss",
    "quantwatch_run_tokens",
    "quantwatch_run_last_step",
    "quantwatch_alert_streak_steps",
    "quantwatch_alert_state",
)


def build(app: object, args: argparse.Namespace) -> float:
    """Ingest the workload through the app's store and observers; returns the seconds it took."""
    state = app.state  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    layers = tuple(f"blocks.{i // 4}.{('q', 'k', 'v', 'o')[i % 4]}" for i in range(args.layers))
    hot = rng.random(args.layers) < 0.05
    started = time.perf_counter()
    for first in range(0, args.steps, 4):
        for r in range(args.runs):
            for rank in range(args.ranks):
                steps = []
                for step in range(first, first + 4):
                    metrics = {m: rng.random(args.layers, dtype=np.float32) * 0.01 for m in METRICS}
                    metrics["output_rel_l2"][hot] = 0.5
                    if step % 10 == 0:
                        metrics["update_cosine"] = 1 - rng.random(args.layers, dtype=np.float32) * 0.01
                    scalars = {"loss": 2.5, "loss_shadow": 2.4, "tokens_per_second": 1.2e4, "step_seconds": 0.3}
                    steps.append(IngestStep(step, 1.7e9 + step, metrics, scalars))
                batch = IngestBatch(f"run-{r:03d}", rank, uuid.uuid4().hex, layers, tuple(steps))
                state.store.ingest(batch, state.ingest_observers)
    return time.perf_counter() - started


def lines(exposition: bytes) -> list[bytes]:
    return [line for line in exposition.splitlines() if line.startswith(tuple(p.encode() for p in COMPARED))]


def compare(live: list[bytes], restored: list[bytes]) -> None:
    """Print how the restored lines compare with the ingesting collector's, series by series."""
    before = dict(line.rsplit(b" ", 1) for line in live)
    after = dict(line.rsplit(b" ", 1) for line in restored)
    both = before.keys() & after.keys()
    same = sum(before[key] == after[key] for key in both)
    print(
        f"  restored lines identical to the ingesting collector's: {restored == live} ({len(live)} lines); "
        f"series in both {len(both)}, same value {same}; only live {len(before.keys() - after.keys())}, "
        f"only restored {len(after.keys() - before.keys())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"code measured: {Path(quantwatch.__file__).resolve().parent.parent}; load {os.getloadavg()}")
    tmp = Path(tempfile.mkdtemp(prefix="qw-restore-"))
    rules = tmp / "rules.yml"
    rules.write_text(
        "default_rules: false\n"
        "rules:\n  - {name: drift, metric: output_rel_l2, op: '>', threshold: 0.1, consecutive: 3}\n"
    )
    with contextlib.ExitStack() as scratch:
        scratch.callback(shutil.rmtree, tmp)
        if args.backend == "sqlite":
            url = f"sqlite:///{tmp / 'quantwatch.db'}"
        else:
            url = scratch.enter_context(postgres_database("qw_bench_restore"))
        measure(Settings(database_url=url, rules_file=str(rules)), args)


def measure(settings: Settings, args: argparse.Namespace) -> None:
    """Build the database of ``settings`` and time the restore from it."""
    app = create_app(settings)
    seconds = build(app, args)
    print(
        f"{args.backend}: {args.runs} runs x {args.ranks} ranks x {args.layers} layers x {args.steps} steps "
        f"(8 metrics every step, update_cosine every 10th, 4 scalars) ingested in {seconds:.0f} s"
    )
    with app.state.engine.connect() as conn:
        if args.backend == "sqlite":
            size = (
                conn.exec_driver_sql("PRAGMA page_count").scalar_one()
                * conn.exec_driver_sql("PRAGMA page_size").scalar_one()
            )
        else:
            size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        points = conn.execute(text("SELECT count(*) FROM points")).scalar_one()
    print(f"  database {size / 1e6:.0f} MB, {points} point rows")
    live = lines(app.state.exposition.render())
    times, cpu = [], []
    for _ in range(args.repeat):
        cache = LatestValueCache()
        restore = StartupRestore(app.state.store.factory)
        started = time.process_time()
        restore.restore(cache)
        cpu.append(time.process_time() - started)
        times.append(restore.seconds)
    tracemalloc.start()  # once more, for the memory only: tracing slows every allocation down
    StartupRestore(app.state.store.factory).restore(LatestValueCache())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QuantWatchCollector(cache, alerts=alert_series_source(_NoEngine(), restore.alert_series)))
    restored = lines(render_exposition(registry))
    print(
        f"  restore: {restore.runs_restored} runs, {restore.ranks_restored} ranks, "
        f"{restore.series_restored} alert series; wall seconds median {statistics.median(times):.3f} "
        f"(all: {', '.join(f'{t:.3f}' for t in times)}), process CPU seconds median {statistics.median(cpu):.3f}; "
        f"peak Python memory {peak / 1e6:.1f} MB"
    )
    compare(live, restored)
    app.state.engine.dispose()


class _NoEngine:
    """An alert engine that evaluated nothing yet (a collector just started)."""

    def latest_states(self) -> list[object]:
        return []


if __name__ == "__main__":
    main()
