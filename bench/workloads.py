"""Per-layer values for storage benchmarks (issue 21): real training series replayed at scale, a random walk, and
uniform random numbers (incompressible, shown only as the bound).

Real series come from bench/data/series.npz (bench/record_series.py): the demo's 9 layers and the agent benchmark
model's 16, 400 steps each. Replayed at scale, each of ``layers`` target layers takes one source layer's series of
one metric, from its own start step (running back and forth through the 400 recorded steps, so it stays a smooth
series) and scaled by its own factor (a random float32 multiplier: the layers' bits differ as different layers'
do, so nothing repeats across layers that a compressor could exploit beyond what real layers offer).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

SERIES = Path(__file__).parent / "data" / "series.npz"

Values = Callable[[int, int], np.ndarray]
"""values(metric index, step) -> float32 row of the layers (NaN: not measured)."""


def replayed(source: str, layers: int, metrics: int, seed: int = 0) -> Values:
    """Recorded series of ``source`` (``demo`` or ``agent``) replayed over ``layers`` × ``metrics``."""
    data = np.load(SERIES)
    names = sorted(k for k in data.files if k.startswith(f"{source}/"))
    rng = np.random.default_rng(seed)
    tables = []
    for m in range(metrics):
        matrix = data[names[m % len(names)]]
        steps, width = matrix.shape
        src = np.arange(layers) % width
        start = rng.integers(0, 2 * steps, layers)
        factor = np.exp(rng.normal(0.0, 0.5, layers)).astype(np.float32)
        tables.append((matrix, src, start, factor))

    def values(metric: int, step: int) -> np.ndarray:
        matrix, src, start, factor = tables[metric]
        n = matrix.shape[0]
        t = (step + start) % (2 * n)
        t = np.where(t < n, t, 2 * n - 1 - t)  # back and forth: the series stays continuous
        return (matrix[t, src] * factor).astype(np.float32)

    return values


def random_walk(layers: int, metrics: int, seed: int = 0, step_ratio: float = 0.01) -> Values:
    """Each layer's value a geometric random walk from its own level, moving by ``step_ratio`` per step."""
    rng = np.random.default_rng(seed)
    level = np.exp(rng.normal(-3.5, 0.5, (metrics, layers)))
    state = {"step": -1, "log": np.log(level)}
    rows: dict[tuple[int, int], np.ndarray] = {}

    def values(metric: int, step: int) -> np.ndarray:
        while state["step"] < step:
            state["log"] = state["log"] + rng.normal(0.0, step_ratio, (metrics, layers))
            state["step"] += 1
            rows.clear()
        return rows.setdefault((metric, step), np.exp(state["log"][metric]).astype(np.float32))

    return values


def uniform(layers: int, metrics: int, seed: int = 0) -> Values:
    """Uniform random numbers in [0, 0.04): incompressible (every mantissa bit random), the bound, not a workload."""
    rng = np.random.default_rng(seed)

    def values(metric: int, step: int) -> np.ndarray:
        return rng.random(layers, dtype=np.float32) * np.float32(0.04)

    return values


WORKLOADS: dict[str, Callable[[int, int], Values]] = {
    "demo": lambda layers, metrics: replayed("demo", layers, metrics),
    "agent": lambda layers, metrics: replayed("agent", layers, metrics, seed=1),
    "random-walk": random_walk,
    "uniform (incompressible)": uniform,
}
