"""Prometheus exposition at scale: 100 runs x 512 layers ingested, scrape time percentiles.

    .venv/bin/python bench/exposition.py [--runs 100] [--layers 512] [--scrapes 200]

Prints, measured side by side in one run:
* scrape time (p50/p99) of the fast writer when nothing changed since the last scrape (the common case: Prometheus
  scrapes every 5-15 s, a run sends a batch every few seconds);
* scrape time when 10% / 100% of the runs sent a batch since the last scrape (their lines are re-rendered);
* prometheus_client's generate_latest on the same registry, as the reference and the ratio;
* the cache's cost per ingested batch (512 layers x 8 metrics, 4 steps).

Each scrape is timed in wall-clock and in CPU time of the scraping thread: on a machine whose cores are shared the
second leaves out the time spent waiting for a core.

To compare two checkouts side by side, run this file of either one with ``PYTHONPATH`` set to each checkout in turn:
the first line printed names the code measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from _common import METRICS
from prometheus_client import CollectorRegistry, generate_latest

import quantwatch
from quantwatch.service.exposition import (
    AlertSeries,
    IngestMetrics,
    LatestValueCache,
    QuantWatchCollector,
    StepValues,
    render_exposition,
)


def batch(rng: np.random.Generator, step: int, n_layers: int, n_steps: int = 4) -> list[StepValues]:
    return [
        StepValues(
            step + i,
            {m: rng.random(n_layers, dtype=np.float32) for m in METRICS},
            {"loss": 2.5, "loss_shadow": 2.4, "tokens_per_second": 1.2e4, "step_seconds": 0.3},
        )
        for i in range(n_steps)
    ]


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--layers", type=int, default=512)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cache = LatestValueCache(top_k=64)
    layers = [f"blocks.{i // 4}.{('attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2')[i % 4]}" for i in range(args.layers)]
    runs = [f"sweep/run-{i:03d}" for i in range(args.runs)]
    batches = [batch(rng, 0, args.layers) for _ in range(8)]

    observe_seconds = []
    for i, run in enumerate(runs):
        t0 = time.perf_counter()
        cache.observe(run, 0, layers, batches[i % len(batches)])
        observe_seconds.append(time.perf_counter() - t0)
    alerts = [AlertSeries("quantwatch_output_deviation", run, layers[j], 3, "firing") for run in runs for j in range(4)]
    ingest = IngestMetrics()
    registry = CollectorRegistry()
    registry.register(QuantWatchCollector(cache, ingest, lambda: alerts))
    render_exposition(registry)  # first render of every slot

    def timed(changed_runs: int, writer: object, scrapes: int) -> tuple[list[float], list[float]]:
        """Wall-clock and CPU seconds of each scrape (CPU time leaves out waiting for a shared core)."""
        wall, cpu = [], []
        step = 100
        for k in range(scrapes):
            for run in runs[(k * changed_runs) % len(runs) :][:changed_runs]:
                step += 4
                cache.observe(run, 0, layers, batches[step % len(batches)])
            t0, c0 = time.perf_counter(), time.thread_time()
            writer(registry)  # type: ignore[operator]
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        return wall, cpu

    print(f"code measured: {Path(quantwatch.__file__).parent.parent}")
    size = len(render_exposition(registry))
    lines = render_exposition(registry).count(b"\n")
    print(f"{args.runs} runs x {args.layers} layers x {len(METRICS)} metrics ingested, top_k=64: ")
    print(f"  exposition {size / 1e6:.2f} MB, {lines} lines")
    o50, o99 = percentiles(observe_seconds)
    print(f"  cache.observe per batch (4 steps x {len(METRICS)} metrics): p50 {o50:.2f} ms  p99 {o99:.2f} ms")
    rows = []
    for label, changed in (
        ("nothing changed", 0),
        ("10% of runs changed", args.runs // 10),
        ("all runs changed", args.runs),
    ):
        wall, cpu = timed(changed, render_exposition, args.scrapes)
        (w50, w99), (c50, c99) = percentiles(wall), percentiles(cpu)
        rows.append((label, w99, c99))
        print(f"  scrape, {label:<20}: wall p50 {w50:7.2f} ms  p99 {w99:7.2f} ms", end="")
        print(f" | CPU p50 {c50:7.2f} ms  p99 {c99:7.2f} ms")
    wall, cpu = timed(0, generate_latest, max(5, args.scrapes // 20))
    reference = percentiles(wall)
    print(f"  scrape, nothing changed, prometheus_client generate_latest: wall p50 {reference[0]:7.2f} ms", end="")
    print(f"  CPU p50 {percentiles(cpu)[0]:7.2f} ms")
    fast_p50 = percentiles(timed(0, render_exposition, args.scrapes)[0])[0]
    print(f"  ratio generate_latest / fast writer (wall p50, nothing changed): {reference[0] / fast_p50:.1f}x")
    for label, w99, c99 in rows:
        verdict = "met" if w99 <= 50 else ("met in CPU time only" if c99 <= 50 else "NOT met")
        print(f"  goal p99 <= 50 ms, {label}: {verdict}")


if __name__ == "__main__":
    main()
