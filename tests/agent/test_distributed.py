"""Two ranks in a gloo process group on CPU: the rank comes from torch.distributed, ``ranks`` picks who reports."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent(
    """
    import json, sys
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
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("ranks", "reporting"), [("all", [True, True]), ("first", [True, False])])
def test_two_gloo_ranks(tmp_path: Path, ranks: object, reporting: list[bool]) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, str(tmp_path), json.dumps(ranks)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["rank"] == rank
        assert result["reporting"] is reporting[rank]
        # Every rank of the replica group sends its weight fingerprints on sampled steps; only reporting ranks
        # send metrics.
        assert result["batches"] == [{"rank": rank, "steps": [0, 1]}]
        assert result["groups"] == [[0, 1], [0, 1]]
        assert (result["metrics"] == ["output_rel_l2"]) is reporting[rank]
        assert (result["metrics"] == []) is not reporting[rank]
