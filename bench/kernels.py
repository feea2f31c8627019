"""Bandwidth of quantize + all error statistics: eager reference vs the fused path, against x.sum().

    .venv/bin/python bench/kernels.py [--numel 16777216] [--repeats 5] [--cpu-time] [--cache cold|warm] [--march M]

Prints GB/s (input bytes / second: the tensor is read, the quantized copy written once) for the plain-torch
reference and the fused paths of fp8_e4m3 per-tensor, mxfp4, nvfp4 and int8 with a scale per row (``channel:0``, a
weight's output channels), and of fp8_e5m2 with blocks of 32 (what-if's gradient candidate) and nvfp4 rounding to
nearest and stochastically (``+sr``: the uniform draws included, as `quantize` draws them; the line ``draws`` times
``torch.rand`` of x's size alone) — each ``quantize(..., with_stats=True)`` — and, in the same run, the read
bandwidth of ``x.sum()`` as the physical limit. On the CPU the fused paths are ``compiled`` (torch.compile) and
``native`` (the hand-written kernels, what ``auto`` picks), the latter also with ``out=`` (one output buffer reused,
as a training loop would); on CUDA, Triton. Ratios: each fused path / x.sum, the fastest fused path / x.sum, and the
fastest fused path / reference. The first lines say the CPU model, its widest vector unit, and what the native
kernels were built for: ``--march haswell`` builds them for AVX2 (8-float vectors) on any AVX2 host, an AVX-512 one
included (default: ``$QUANTWATCH_NATIVE_MARCH``, else ``native``, this CPU).

``--cpu-time`` runs on one thread and takes the fastest call by thread CPU time instead of the median wall time:
on a machine shared with other work that figure moves far less (it still counts memory stalls). ``x.sum()``,
``x * 2`` and the fused cases are called in turn, round after round, so their ratios hold under the same load.

Every timed call starts from the same cache state, or the ratios compare different things: a 67 MB tensor fits in
some CPUs' last-level cache, and ``x.sum()`` right after a call that read x ran twice as fast as after one that wrote
a fresh output. ``--cache cold`` (the default) reads a buffer twice the size of the last-level cache before each
call, so every call reads x from memory (as a training step mostly reads its tensors); ``--cache warm`` reads x
(``x.sum()``) before each call, so every call finds as much of x in the caches as they hold.

The line ``x * 2 read+write`` is the floor of any operation that returns a new tensor of x's size: glibc maps an
allocation this large fresh from the kernel and unmaps it on free, so every call pays a page fault per 4 KiB of
output, and the kernel zeroes each page (more CPU time than the native kernels themselves); ``x * 2, out=`` is the
same without the allocation. ``quantize(..., out=buffer)`` avoids it; or run with
``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296`` (glibc keeps freed memory) or
``THP_MEM_ALLOC_ENABLE=1`` (torch asks for huge pages) to measure the kernels without that cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from quantwatch.kernels import native, quantize

CASES = [
    ("fp8_e4m3 per-tensor", "fp8_e4m3", "tensor", "nearest"),
    ("mxfp4", "mxfp4", None, "nearest"),
    ("nvfp4", "nvfp4", None, "nearest"),
    ("int8 per-channel", "int8", "channel:0", "nearest"),
    ("fp8_e5m2 block:32", "fp8_e5m2", "block:32", "nearest"),
    ("fp8_e5m2 block:32 +sr", "fp8_e5m2", "block:32", "stochastic"),
    ("nvfp4 +sr", "nvfp4", None, "stochastic"),
]


def cpu_description() -> str:
    """The CPU model and its widest x86 vector unit, from /proc/cpuinfo (``unknown`` where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    unit = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model}, {unit}"


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (64 MiB when it cannot be read)."""
    sizes = [64 << 20]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KM":
            sizes.append(int(text[:-1]) << (10 if text[-1] == "K" else 20))
    return max(sizes)


def cache_preparation(x: torch.Tensor, cache: str) -> Callable[[], object]:
    """What runs before each timed call: evict x (``cold``) or read it (``warm``)."""
    if cache == "warm":
        return lambda: x.sum().item()
    # Twice the last-level cache on the CPU; on a GPU, 256 MB is several times any L2. Read, not written: written,
    # the caches would hold dirty lines that the timed call pays to write back.
    numel = (2 * last_level_cache_bytes() if x.device.type == "cpu" else 256 << 20) // 4
    flush = torch.ones(numel, device=x.device)
    return lambda: flush.sum().item()


def seconds_per_call(
    fn: Callable[[], object], repeats: int, device: torch.device, cpu_time: bool, prepare: Callable[[], object]
) -> float:
    """Median wall time (or fastest thread CPU time) of ``repeats`` calls after one warm-up call (which compiles),
    each call after ``prepare()``."""
    return seconds_interleaved({"fn": fn}, repeats, device, cpu_time, prepare)["fn"]


def seconds_interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    cpu_time: bool,
    prepare: Callable[[], object],
) -> dict[str, float]:
    """`seconds_per_call` of several functions called in turn, round after round, so that each ratio between them
    is taken under the same load of a shared machine (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    clock = time.thread_time if cpu_time else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            prepare()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(clock() - start)
    return {name: min(t) if cpu_time else statistics.median(t) for name, t in times.items()}


def main() -> None:
    """Run the benchmark and print one table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, fastest call by thread CPU time")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold", help="x evicted or read before each call")
    parser.add_argument("--march", help="-march target of the native kernels (e.g. haswell: an AVX2 build)")
    args = parser.parse_args()
    if args.march:
        os.environ[native.MARCH_ENV] = native.march(args.march)
    if args.cpu_time:
        torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).reshape(-1, 4096).to(device)
    gigabytes = x.numel() * x.element_size() / 1e9
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"torch {torch.__version__}, {device.type}, threads {torch.get_num_threads()}, load average {load}")
    if device.type == "cpu":
        built = native.vector_isa() if native.available() else "unavailable"
        print(f"cpu: {cpu_description()}; native kernels: -march={native.march()}, {built} vectors")
    how = "fastest thread CPU time" if args.cpu_time else "median wall time"
    print(f"x: {tuple(x.shape)} float32 = {gigabytes * 1e3:.0f} MB; {how} of {args.repeats} calls after warm-up")
    prepare = cache_preparation(x, args.cache)
    state = "x evicted from the caches" if args.cache == "cold" else "x read just before"
    print(f"cache {args.cache}: every call with {state}")
    # x.sum(), x * 2 and the fused cases take turns in each round (one round per repeat, x.sum() and x * 2 four
    # times a round): the ratios compare calls made under the same load. The reference is slow and runs apart.
    fused = ["triton"] if device.type == "cuda" else ["compiled", "native", "native, out="]
    out = torch.empty_like(x)
    timed: dict[str, Callable[[], object]] = {}
    for index in range(4):
        timed[f"sum{index}"] = lambda: x.sum().item()
        timed[f"double{index}"] = lambda: x * 2
        timed[f"double_out{index}"] = lambda: torch.mul(x, 2, out=out)
    timed["draws"] = lambda: torch.rand(x.shape, device=x.device)
    for label, fmt, scaling, rounding in CASES:
        for path in fused:
            backend, _, reuse = path.partition(", ")
            timed[f"{label} {path}"] = (
                lambda fmt=fmt, scaling=scaling, rounding=rounding, backend=backend, reuse=reuse: quantize(
                    x, fmt, scaling, rounding, with_stats=True, backend=backend, out=out if reuse else None
                )
            )
    seconds = seconds_interleaved(timed, args.repeats, device, args.cpu_time, prepare)
    pick = min if args.cpu_time else statistics.median
    read = gigabytes / pick(seconds[f"sum{index}"] for index in range(4))
    print(f"{'x.sum() read':<24}{read:>10.3f} GB/s")
    for name, label in [("double", "x * 2 read+write"), ("double_out", "x * 2, out= read+write")]:
        rate = gigabytes / pick(seconds[f"{name}{index}"] for index in range(4))
        print(f"{label:<24}{rate:>10.3f} GB/s ({rate / read:.3f} × x.sum)")
    draws = gigabytes / seconds["draws"]
    print(f"{'draws (torch.rand)':<24}{draws:>10.3f} GB/s ({draws / read:.3f} × x.sum)")
    columns = "".join(f"{path:>14}" for path in fused)
    ratios = "".join(f"{path + '/x.sum':>20}" for path in fused)
    print(f"{'GB/s':<24}{'reference':>11}{columns}{ratios}{'best/x.sum':>12}{'best/ref':>10}")
    for label, fmt, scaling, rounding in CASES:
        reference = gigabytes / seconds_per_call(
            lambda fmt=fmt, scaling=scaling, rounding=rounding: quantize(
                x, fmt, scaling, rounding, with_stats=True, backend="reference"
            ),
            max(1, args.repeats // 2),
            device,
            args.cpu_time,
            prepare,
        )
        rates = [gigabytes / seconds[f"{label} {path}"] for path in fused]
        cells = "".join(f"{rate:>14.3f}" for rate in rates)
        cells += "".join(f"{rate / read:>20.3f}" for rate in rates)
        best = max(rates)
        print(f"{label:<24}{reference:>11.4f}{cells}{best / read:>12.3f}{best / reference:>10.1f}")


if __name__ == "__main__":
    main()
