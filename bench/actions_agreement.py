"""The cost of agreeing on actions across ranks (issue 18): what ``monitor.step`` adds at the steps where the ranks of a
gloo group compare their pending action requests, and at the steps in between.

Two processes on loopback (gloo, CPU) each time the action loop's step boundary of a monitor with nothing to
deliver: at an agreement step (a multiple of the sampling period: one ``all_reduce(MAX)`` of one integer), at the
steps in between (nothing), and at an agreement step where one rank has a request (the all_reduce, an
``all_gather_object`` of the requests and applying the union: one QuantLinear switched to FP8).

    .venv/bin/python bench/actions_agreement.py            # 2 ranks, 2000 boundaries of each kind
    .venv/bin/python bench/actions_agreement.py --reps 200
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

WORKER = textwrap.dedent(
    """
    import json, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    import quantwatch.agent as qw
    from quantwatch.agent.actions import Request
    from quantwatch.kernels import quantize_model, Recipe, QuantConfig

    rank, port, reps, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = quantize_model(nn.Sequential(nn.Linear(64, 64)), Recipe(default=QuantConfig()))
    monitor = qw.attach(model, run="bench", exporter=qw.InMemoryExporter(), every=25)
    loop = monitor._loop

    def timed(steps, before=None):
        seconds = []
        for step in steps:
            if before is not None:
                before(step)
            dist.barrier()
            started = time.perf_counter()
            loop.boundary(step)
            seconds.append(time.perf_counter() - started)
        seconds.sort()
        return {"p50_us": seconds[len(seconds) // 2] * 1e6, "mean_us": sum(seconds) / len(seconds) * 1e6}

    between = timed([25 * k + 1 for k in range(reps)])
    agreement = timed([25 * k for k in range(reps)])
    fmt = ["fp8", None]
    acting = timed([25 * k for k in range(max(1, reps // 10))],
                   lambda step: rank == 0 and loop.request(Request("keep_high_precision", ("0",), fmt[step // 25 % 2])))
    monitor.close()
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump({"between": between, "agreement": agreement, "acting": acting}, fh)
    dist.destroy_process_group()
    """
)


def main() -> None:
    """Run the two ranks and print the per-boundary times of rank 0 and 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
        sock.close()
        script = Path(scratch) / "worker.py"
        script.write_text(WORKER)
        procs = [
            subprocess.Popen([sys.executable, str(script), str(rank), port, str(args.reps), scratch]) for rank in (0, 1)
        ]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"a rank failed with {proc.returncode}")
        results = [json.loads((Path(scratch) / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for kind, what in (
        ("between", "step between agreement steps"),
        ("agreement", "agreement step, nothing pending (1 all_reduce)"),
        ("acting", "agreement step, one rank has a request (all_reduce + all_gather_object + switch a layer)"),
    ):
        figures = ", ".join(f"rank {r}: p50 {res[kind]['p50_us']:.1f} µs mean {res[kind]['mean_us']:.1f} µs"
                            for r, res in enumerate(results))  # fmt: skip
        print(f"{what}: {figures}")


if __name__ == "__main__":
    main()
