"""Prometheus exposition at scale: 100 runs x 512 layers ingested, scrape time percentiles.

    .venv/bin/python bench/exposition.py [--runs 100] [--layers 512] [--scrapes 200] [--no-gc-freeze]
        [--steady-seconds 30] [--scrape-every 1.0] [--batch-every 1.0]

Prints, measured side by side in one run:
* scrape time (p50/p99) of the fast writer when nothing changed since the last scrape (the common case: Prometheus
  scrapes every 5-15 s, a run sends a batch every few seconds);
* scrape time when 10% / 100% of the runs sent a batch right before the scrape (their lines are re-rendered by the
  scrape: the worst case, where the background renderer had no time);
* steady ingest: every run sends a batch every ``--batch-every`` seconds from a thread, spread evenly, while the main
  thread scrapes every ``--scrape-every`` seconds, with the background renderer off and on: scrape time, the
  renderer's CPU per second, the whole process's CPU per second and ``observe``'s wall time under the lock;
* prometheus_client's generate_latest on the same registry, as the reference and the ratio;
* the cache's cost per ingested batch (512 layers x 8 metrics, 4 steps).

Each scrape is timed in wall-clock and in CPU time of the scraping thread: on a machine whose cores are shared the
second leaves out the time spent waiting for a core. Full (generation 2) garbage collections that ran inside a scrape
are counted: their pause is the process's whole heap, not the exposition. Like ``quantwatch serve``, the benchmark
freezes the heap it has built before anything is ingested (``--no-gc-freeze`` leaves it to the collector).

To compare two checkouts side by side, run this file of either one with ``PYTHONPATH`` set to each checkout in turn:
the first line printed names the code measured.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import METRICS
from prometheus_client import CollectorRegistry, generate_latest

import quantwatch
from quantwatch.service import exposition
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


class FullCollections:
    """A ``gc`` callback that counts generation-2 collections and adds up their seconds."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started


@dataclass
class Steady:
    """What a steady-ingest run measured: seconds of each scrape and each observe, CPU seconds per second."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    observe: list[float] = field(default_factory=list)
    renderer_cpu_per_second: float = 0.0
    process_cpu_per_second: float = 0.0


def steady(
    cache: LatestValueCache,
    registry: CollectorRegistry,
    runs: list[str],
    layers: list[str],
    batches: list[list[StepValues]],
    args: argparse.Namespace,
    renderer: Any,
) -> Steady:
    """Batches arriving evenly from an ingest thread while this thread scrapes on a fixed schedule."""
    out = Steady()
    stopping = threading.Event()

    def ingest() -> None:
        gap = args.batch_every / len(runs)
        due = time.perf_counter()
        k = 0
        while not stopping.is_set():
            t0 = time.perf_counter()
            cache.observe(runs[k % len(runs)], 0, layers, batches[k % len(batches)])
            out.observe.append(time.perf_counter() - t0)
            k += 1
            due += gap
            time.sleep(max(0.0, due - time.perf_counter()))

    feeder = threading.Thread(target=ingest, daemon=True)
    if renderer is not None:
        renderer.start()
    process0 = time.process_time()
    feeder.start()
    started = time.perf_counter()
    due = started + args.scrape_every
    while time.perf_counter() < started + args.steady_seconds:
        time.sleep(max(0.0, due - time.perf_counter()))
        due += args.scrape_every
        t0, c0 = time.perf_counter(), time.thread_time()
        render_exposition(registry)
        out.wall.append(time.perf_counter() - t0)
        out.cpu.append(time.thread_time() - c0)
    elapsed = time.perf_counter() - started
    stopping.set()
    feeder.join()
    out.process_cpu_per_second = (time.process_time() - process0) / elapsed
    if renderer is not None:
        renderer.stop()
        out.renderer_cpu_per_second = renderer.cpu_seconds / elapsed
    return out


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--layers", type=int, default=512)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--no-gc-freeze", action="store_true", help="do not freeze the startup heap (serve does)")
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--scrape-every", type=float, default=1.0)
    parser.add_argument("--batch-every", type=float, default=1.0, help="seconds between two batches of one run")
    args = parser.parse_args()
    full_collections = FullCollections()
    gc.callbacks.append(full_collections)
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()
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

    def timed(changed_runs: int, writer: object, scrapes: int) -> tuple[list[float], list[float], list[float]]:
        """Wall-clock and CPU seconds of each scrape (CPU time leaves out waiting for a shared core), and the seconds
        of each full garbage collection that ran inside one."""
        wall, cpu, pauses = [], [], []
        step = 100
        for k in range(scrapes):
            for run in runs[(k * changed_runs) % len(runs) :][:changed_runs]:
                step += 4
                cache.observe(run, 0, layers, batches[step % len(batches)])
            g0, gs0 = full_collections.count, full_collections.seconds
            t0, c0 = time.perf_counter(), time.thread_time()
            writer(registry)  # type: ignore[operator]
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            if full_collections.count > g0:
                pauses.append(full_collections.seconds - gs0)
        return wall, cpu, pauses

    print(f"code measured: {Path(quantwatch.__file__).parent.parent}")
    print(
        f"  startup heap {'left to the collector' if args.no_gc_freeze else 'frozen'}: {gc.get_freeze_count()} objects"
    )
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
        wall, cpu, pauses = timed(changed, render_exposition, args.scrapes)
        (w50, w99), (c50, c99) = percentiles(wall), percentiles(cpu)
        rows.append((label, w99, c99))
        print(f"  scrape, {label:<20}: wall p50 {w50:7.2f} ms  p99 {w99:7.2f} ms", end="")
        print(f" | CPU p50 {c50:7.2f} ms  p99 {c99:7.2f} ms", end="")
        print(f" | full GC in {len(pauses)} scrapes, {max(pauses, default=0) * 1e3:.1f} ms at most")
    wall, cpu, _ = timed(0, generate_latest, max(5, args.scrapes // 20))
    reference = percentiles(wall)
    print(f"  scrape, nothing changed, prometheus_client generate_latest: wall p50 {reference[0]:7.2f} ms", end="")
    print(f"  CPU p50 {percentiles(cpu)[0]:7.2f} ms")
    fast_p50 = percentiles(timed(0, render_exposition, args.scrapes)[0])[0]
    print(f"  ratio generate_latest / fast writer (wall p50, nothing changed): {reference[0] / fast_p50:.1f}x")
    renderer_class = getattr(exposition, "BackgroundRenderer", None)  # absent from code before it
    print(
        f"  steady ingest: a batch from each run every {args.batch_every} s ({len(runs) / args.batch_every:.0f}"
        f" batches/s, from a thread), a scrape every {args.scrape_every} s, for {args.steady_seconds} s:"
    )
    for with_renderer in (False, True) if renderer_class is not None else (False,):
        renderer = renderer_class(cache) if with_renderer else None
        label = f"steady, renderer {'on' if with_renderer else 'off'}"  # row label of the goal lines
        result = steady(cache, registry, runs, layers, batches, args, renderer)
        (w50, w99), (c50, c99) = percentiles(result.wall), percentiles(result.cpu)
        rows.append((label, w99, c99))
        print(f"  scrape, {label:<20}: wall p50 {w50:7.2f} ms  p99 {w99:7.2f} ms", end="")
        print(f" | CPU p50 {c50:7.2f} ms  p99 {c99:7.2f} ms ({len(result.wall)} scrapes)")
        print(f"    renderer CPU {result.renderer_cpu_per_second * 1e3:.1f} ms/s", end="")
        print(f" | process CPU {result.process_cpu_per_second * 1e3:.0f} ms/s", end="")
        print(
            f" | observe wall p50 {percentiles(result.observe)[0]:.2f} ms  p99 {percentiles(result.observe)[1]:.2f} ms"
        )
    for label, w99, c99 in rows:
        verdict = "met" if w99 <= 50 else ("met in CPU time only" if c99 <= 50 else "NOT met")
        print(f"  goal p99 <= 50 ms, {label}: {verdict}")


if __name__ == "__main__":
    main()
