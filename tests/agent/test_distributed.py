"""Two ranks in a gloo process group on CPU: the rank comes from torch.distributed, ``ranks`` picks who reports."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    import torch.nn.functional as F
    import quantwatch.agent as qw

    class Protocol(nn.Linear):
        def forward(self, x):
            return F.linear(x, torch.round(self.weight * 4) / 4, self.bias)
        def reference_forward(self, x):
            return F.linear(x, self.weight, self.bias)

    rank, world, port, out, ranks = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(Protocol(4, 4))
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="ddp", exporter=sink, every=1, ranks=ranks, metrics=["output_rel_l2"])
    for step in range(2):
        x = torch.randn(8, 4) * (rank + 1)
        loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():  # a hand-rolled all-reduce of the gradients, as DDP would do
            dist.all_reduce(p.grad)
        monitor.step(step, loss=loss)
    monitor.close(10)
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump({"rank": monitor.rank, "reporting": monitor.reporting,
                   "batches": [{"rank": b.rank, "steps": [r.step for r in b.steps]} for b in sink.batches],
                   "metrics": sorted({m for b in sink.batches for r in b.steps for m in r.metrics}),
                   "groups": [list(r.fingerprints.group) for b in sink.batches for r in b.steps]}, fh)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (pytorch/pytorch#190489)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_two_ranks(worker: str, tmp_path: Path, timeout: float, *args: str) -> list[Any]:
    """Run ``worker`` as ranks 0 and 1 of one process group (argv: rank, port, output folder, ``args``); what each
    rank wrote to ``rank{N}.json``, by rank."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, str(tmp_path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    errors = [proc.communicate(timeout=timeout)[1] for proc in procs]
    for rank, (proc, err) in enumerate(zip(procs, errors, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{err}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize(("ranks", "reporting"), [("all", [True, True]), ("first", [True, False])])
def test_two_gloo_ranks(tmp_path: Path, ranks: object, reporting: list[bool]) -> None:
    for rank, result in enumerate(_run_two_ranks(WORKER, tmp_path, 120, json.dumps(ranks))):
        assert result["rank"] == rank
        assert result["reporting"] is reporting[rank]
        # Every rank of the replica group sends its weight fingerprints on sampled steps; only reporting ranks
        # send metrics.
        assert result["batches"] == [{"rank": rank, "steps": [0, 1]}]
        assert result["groups"] == [[0, 1], [0, 1]]
        assert (result["metrics"] == ["output_rel_l2"]) is reporting[rank]
        assert (result["metrics"] == []) is not reporting[rank]


WRAPPED_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    import quantwatch.agent as qw
    from quantwatch.kernels import QuantConfig, Recipe, quantize_model

    rank, world, port, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def make_model():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        return quantize_model(model, Recipe(rules=[("*", QuantConfig())]))

    def train(wrapped, params, name):
        sink = qw.InMemoryExporter()
        monitor = qw.attach(wrapped, run=name, exporter=sink, every=1)
        opt = torch.optim.SGD(params, lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for step in range(2):
            loss = wrapped(torch.randn(8, 16, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            monitor.step(step, loss=loss)
        monitor.close(10)
        return {"layers": list(monitor.layers), "failures": monitor.stats()["failures"],
                "steps": [{"step": r.step, "metrics": dict(r.metrics)} for _, r in sink.records()]}

    results = {}
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    results["ddp"] = train(ddp, ddp.parameters(), "ddp")

    from torch.distributed.fsdp import fully_shard
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    results["fsdp2"] = train(model, model.parameters(), "fsdp2")

    # The same layers and batches without any wrapper: what FSDP2's figures must equal.
    model = make_model()
    results["plain"] = train(model, model.parameters(), "plain")
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (pytorch/pytorch#190489)
    """
)


def test_ddp_and_fsdp2_report_every_metric_on_every_rank_under_the_bare_names(tmp_path: Path) -> None:
    import quantwatch.agent as qw

    for results in _run_two_ranks(WRAPPED_WORKER, tmp_path, 180):
        for wrapper in ("ddp", "fsdp2"):
            result = results[wrapper]
            assert result["layers"] == ["0", "2"], wrapper  # no `module.` prefix
            assert result["failures"] == {}, wrapper
            assert [s["step"] for s in result["steps"]] == [0, 1]
            for step in result["steps"]:
                assert set(step["metrics"]) == set(qw.DEFAULT_METRICS), wrapper
                for metric, values in step["metrics"].items():
                    assert all(v is not None for v in values), (wrapper, metric)
        # FSDP2's reference used the unsharded weights the forward used, and the update comparison this rank's own
        # gradient: at step 0 (before the averaged gradients move the weights apart) the figures are the bare model's.
        fsdp_step, plain_step = results["fsdp2"]["steps"][0], results["plain"]["steps"][0]
        for metric in ("output_rel_l2", "output_cosine", "update_cosine", "weight_rel_l2", "grad_rel_l2"):
            assert fsdp_step["metrics"][metric] == pytest.approx(plain_step["metrics"][metric], rel=1e-5), metric
