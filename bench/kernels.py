"""Bandwidth of quantize + all error statistics: eager reference vs the fused path, against x.sum().

    .venv/bin/python bench/kernels.py [--numel 16777216] [--repeats 5]

Prints GB/s (input bytes / second: the tensor is read, the quantized copy written once) for the plain-torch
reference and the fused path (``torch.compile`` on CPU, Triton on CUDA) of fp8_e4m3 per-tensor, mxfp4 and nvfp4 —
each ``quantize(..., with_stats=True)`` — and, in the same run, the read bandwidth of ``x.sum()`` as the physical
limit, with the ratios fused / x.sum and fused / reference.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from quantwatch.kernels import quantize

CASES = [("fp8_e4m3 per-tensor", "fp8_e4m3", "tensor"), ("mxfp4", "mxfp4", None), ("nvfp4", "nvfp4", None)]


def seconds_per_call(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call (which compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Run the benchmark and print one table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fused_backend = "triton" if device.type == "cuda" else "compiled"
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).reshape(-1, 4096).to(device)
    gigabytes = x.numel() * x.element_size() / 1e9
    print(f"torch {torch.__version__}, {device.type}, threads {torch.get_num_threads()}, {platform.processor()}")
    print(f"x: {tuple(x.shape)} float32 = {gigabytes * 1e3:.0f} MB; median of {args.repeats} calls after warm-up")
    read = gigabytes / seconds_per_call(lambda: x.sum().item(), args.repeats * 4, device)
    print(f"{'x.sum() read':<24}{read:>10.2f} GB/s")
    print(f"{'case':<24}{'reference':>12}{'fused':>12}{'fused/x.sum':>14}{'fused/ref':>12}")
    for label, fmt, scaling in CASES:
        reference = gigabytes / seconds_per_call(
            lambda fmt=fmt, scaling=scaling: quantize(x, fmt, scaling, with_stats=True, backend="reference"),
            max(1, args.repeats // 2),
            device,
        )
        fused = gigabytes / seconds_per_call(
            lambda fmt=fmt, scaling=scaling: quantize(x, fmt, scaling, with_stats=True, backend=fused_backend),
            args.repeats,
            device,
        )
        print(f"{label:<24}{reference:>10.2f}GB/s{fused:>8.2f}GB/s{fused / read:>14.3f}{fused / reference:>12.1f}")


if __name__ == "__main__":
    main()
