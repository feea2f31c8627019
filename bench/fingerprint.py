"""Cost of one weight fingerprint (cross-rank consistency) against x.sum(), blake2b of the bytes, and the weight's
own quantization statistics that a sampled step computes anyway.

    .venv/bin/python bench/fingerprint.py [--rows 4096] [--cols 4096] [--repeats 7]

The cases are called in turn, round after round, so their ratios hold under the same load; medians of wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from collections.abc import Callable

import torch

from quantwatch.agent.fingerprint import weight_fingerprint
from quantwatch.kernels import quantize


def main() -> None:
    """Print milliseconds per call and the ratio to ``x.sum()``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    w = torch.randn(args.rows, args.cols)
    cases: dict[str, Callable[[], object]] = {
        "x.sum()": lambda: w.sum(),
        "weight_fingerprint": lambda: weight_fingerprint(w),
        "blake2b of the bytes": lambda: hashlib.blake2b(memoryview(w.numpy()).cast("B")).digest(),
        "quantize fp8 with_stats": lambda: quantize(w, "fp8_e4m3", with_stats=True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {load}")
    print(f"w: ({args.rows}, {args.cols}) float32; median of {args.repeats} calls")
    base = statistics.median(times["x.sum()"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<26} {median * 1e3:9.1f} ms  {median / base:6.2f} x.sum")


if __name__ == "__main__":
    main()
