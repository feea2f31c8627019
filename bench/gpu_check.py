"""The checks that need a CUDA GPU, in one table; on a machine without CUDA it says so and exits 0.

    .venv/bin/python bench/gpu_check.py [--numel 268435456] [--repeats 10]

Rows (each ``ok`` / ``FAIL`` / ``skip`` with its figure), under five minutes on one GPU:

* **read bandwidth**: ``x.sum()`` of a float32 tensor of ``--numel`` elements (1 GiB by default): the device's read
  limit, the yardstick of the kernels' rows;
* **triton <case> bit-exact**: ``quantize(x, ..., backend="triton", with_stats=True)`` against the plain-torch
  reference (``backend="reference"``) on a 1M-element tensor: values bit for bit, statistics to 1e-6;
* **triton <case> bandwidth**: the same fused quantize + statistics on the large tensor, input GB/s and its share of
  ``x.sum()``'s (the kernels' goal, issue 2: ≥ 0.25);
* **torchao float8 real FP8**: torchao's ``convert_to_float8_training`` (default config: real ``torch._scaled_mm``
  FP8 GEMMs, SM 8.9+) on a 4-block transformer in bfloat16, a few training steps with the agent attached at
  ``every=1``: the step time against the same model in BF16, the layers ``attach`` found and the metrics they
  reported (none before the torchao adapter is registered);
* **agent sampled steps, no host sync**: QuantWatch's own ``quantize_model`` transformer on CUDA with the agent at
  ``every=1`` (exact, then ``shadow_rows=1/8``), the sampled steps run under
  ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call on the training thread raises, and the row
  names it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS: list[tuple[str, str, str]] = []
KERNEL_CASES = [
    ("fp8_e4m3 per-tensor", "fp8_e4m3", "tensor"),
    ("mxfp4", "mxfp4", None),
    ("nvfp4", "nvfp4", None),
    ("int8 per-channel", "int8", "channel:0"),
]


def row(check: str, status: str, figure: str) -> None:
    """Record and print one row of the table."""
    ROWS.append((check, status, figure))
    print(f"{check:<44} {status:<5} {figure}", flush=True)


def guarded(check: str, fn: Callable[[], None]) -> None:
    """Run one check; an exception makes its row FAIL with the error (the other checks still run)."""
    try:
        fn()
    except Exception as exc:
        traceback.print_exc()
        row(check, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")


def gpu_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(times)


def kernels(numel: int, repeats: int) -> None:
    """Read bandwidth, then the Triton kernels' bit-exactness and bandwidth."""
    from quantwatch.kernels import quantize

    big = torch.randn(numel, device="cuda")
    read_seconds = gpu_seconds(lambda: big.sum(), repeats)
    read_gbs = big.numel() * 4 / read_seconds / 1e9
    row("read bandwidth x.sum()", "ok", f"{read_gbs:.0f} GB/s ({big.numel() * 4 / 2**30:.1f} GiB float32)")
    small = torch.randn(1 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    for label, fmt, scaling in KERNEL_CASES:
        matrix = small.reshape(1024, 1024)

        def exact(fmt: str = fmt, scaling: str | None = scaling, label: str = label, x: torch.Tensor = matrix) -> None:
            q, stats = quantize(x, fmt, scaling, backend="triton", with_stats=True)
            ref, ref_stats = quantize(x, fmt, scaling, backend="reference", with_stats=True)
            same = torch.equal(q.view(torch.int32), ref.view(torch.int32))
            got, want = stats.as_tensor().cpu(), ref_stats.as_tensor().cpu()
            close = torch.allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)
            mismatched = int((q.view(torch.int32) != ref.view(torch.int32)).sum())
            status = "ok" if same and close else "FAIL"
            row(f"triton {label} bit-exact", status, f"{mismatched} of {x.numel()} values differ; stats close: {close}")

        guarded(f"triton {label} bit-exact", exact)

        def bandwidth(fmt: str = fmt, scaling: str | None = scaling, label: str = label) -> None:
            x = big.reshape(-1, 4096)
            out = torch.empty_like(x)
            seconds = gpu_seconds(
                lambda: quantize(x, fmt, scaling, backend="triton", with_stats=True, out=out), repeats
            )
            gbs = x.numel() * 4 / seconds / 1e9
            share = gbs / read_gbs
            row(
                f"triton {label} bandwidth",
                "ok" if share >= 0.25 else "FAIL",
                f"{gbs:.0f} GB/s = {share:.2f} x x.sum()",
            )

        guarded(f"triton {label} bandwidth", bandwidth)


def _train_steps(model: torch.nn.Module, steps: int, vocab: int, monitor: Any = None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator("cuda").manual_seed(1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens = torch.randint(0, vocab, (8, 257), device="cuda", generator=gen)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def float8() -> None:
    """torchao Float8Linear with real FP8 GEMMs, the agent attached."""
    import agent_overhead as bench
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import quantwatch.agent as qw

    if torch.cuda.get_device_capability() < (8, 9):
        row("torchao float8 real FP8", "skip", f"needs SM 8.9+, this GPU is SM {torch.cuda.get_device_capability()}")
        return
    torch.manual_seed(0)
    baseline = bench.TinyLM().to("cuda", torch.bfloat16)
    fp8_model = bench.TinyLM().to("cuda", torch.bfloat16)
    convert_to_float8_training(
        fp8_model, config=Float8LinearConfig(), module_filter_fn=lambda _, fqn: fqn.startswith("blocks.")
    )
    sink = qw.InMemoryExporter()
    monitor = qw.attach(fp8_model, run="gpu-float8", exporter=sink, every=1)
    bf16_times = _train_steps(baseline, 12, bench.VOCAB)[2:]
    fp8_times = _train_steps(fp8_model, 12, bench.VOCAB, monitor)[2:]
    monitor.close(30)
    records = [r for _, r in sink.records()]
    metrics = sorted(records[-1].metrics) if records else []
    failures = monitor.stats()["failures"]
    ratio = statistics.median(fp8_times) / statistics.median(bf16_times)
    status = "ok" if not failures and (metrics or not monitor.layers) else "FAIL"
    row(
        "torchao float8 real FP8 + agent every=1",
        status,
        f"step {ratio:.2f} x BF16; {len(monitor.layers)} layers; metrics {metrics or 'none'}; failures {failures}",
    )


def no_host_sync() -> None:
    """The agent's sampled steps on CUDA under set_sync_debug_mode("error")."""
    import agent_overhead as bench

    import quantwatch.agent as qw

    for shadow_rows in (None, 1 / 8):
        label = f"agent every=1 no host sync (shadow_rows={shadow_rows})"
        model = bench.make_model().to("cuda")
        sink = qw.InMemoryExporter()
        monitor = qw.attach(model, run="gpu-sync", exporter=sink, every=1, shadow_rows=shadow_rows)
        _train_steps(model, 2, bench.VOCAB, monitor)  # warm-up: kernels compiled, allocator primed
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator("cuda").manual_seed(2)
        error = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                tokens = torch.randint(0, bench.VOCAB, (8, 257), device="cuda", generator=gen)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, bench.VOCAB), tokens[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                monitor.step(loss=loss)
        except RuntimeError as exc:
            error = "".join(traceback.format_exception(exc)[-3:]).strip().replace("\n", " | ")[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        monitor.close(30)
        failures = monitor.stats()["failures"]
        reported = [r for _, r in sink.records()]
        measured = sorted(reported[-1].metrics) if reported else []
        if error is not None:
            row(label, "FAIL", f"host sync on the training thread: {error}")
        else:
            status = "ok" if not failures and "output_rel_l2" in measured else "FAIL"
            row(label, status, f"{len(reported)} steps reported, metrics {len(measured)}, failures {failures}")


def main() -> None:
    """Run every check and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--numel", type=int, default=1 << 28)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False here); nothing to check.")
        return
    started = time.perf_counter()
    name = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {name}, SM {torch.cuda.get_device_capability()}", flush=True)
    guarded("kernels", lambda: kernels(args.numel, args.repeats))
    guarded("torchao float8 real FP8 + agent every=1", float8)
    guarded("agent every=1 no host sync", no_host_sync)
    print(f"\n== gpu_check on {name}, {time.perf_counter() - started:.0f} s ==")
    print(f"{'check':<44} {'':<5} figure")
    for check, status, figure in ROWS:
        print(f"{check:<44} {status:<5} {figure}")
    failed = [check for check, status, _ in ROWS if status == "FAIL"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
