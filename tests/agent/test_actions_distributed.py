"""An action in 2-process gloo DDP: requested by one rank alone, applied by both at the same agreed step, and the
replicas' weights stay bit-identical (their fingerprints agree at every sampled step)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.agent.test_distributed import _run_two_ranks

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    import quantwatch.agent as qw
    from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model

    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    fp4 = QuantSpec("fp4_e2m1", scaling="tensor")
    model = quantize_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                           Recipe(default=QuantConfig(weight=fp4, input=fp4, grad=fp4)))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(ddp, run="ddp-actions", exporter=sink, every=4)
    seen = []
    def callback(alert):
        seen.append(alert.episode)
        qw.actions.keep_high_precision([alert.layer], format="fp8")
    monitor.on_alert(callback)
    generator = torch.Generator().manual_seed(rank)
    specs = []
    for step in range(14):
        x = torch.randn(16, 8, generator=generator)
        loss = ddp(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 1 and step == 5:  # only this rank's collector answer named the episode
            monitor._loop.inbox.receive([{"episode": 3, "rule": "quantwatch_update_direction", "layer": "2",
                                          "ranks": [1], "since_step": 5, "severity": "warning"}])
        monitor.step(step, loss=loss.detach())
        specs.append(model[2].weight_quantizer.spec.fmt)
    monitor.close(10)
    records = [(b, r) for b in sink.batches for r in b.steps]
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump({
            "seen": seen,
            "specs": specs,
            "actions": [[a.step, a.action, a.layer, a.episode] for b in sink.batches for a in b.actions],
            "hashes": {r.step: list(r.fingerprints.hash) for b, r in records if r.fingerprints is not None},
            "formats": {r.step: [dict(f or {}) for f in b.layer_formats or ()] for b, r in records if r.metrics},
            "failures": monitor.stats()["failures"],
        }, fh)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (pytorch/pytorch#190489)
    """
)


def test_an_action_requested_on_one_rank_takes_effect_on_both_at_the_same_step(tmp_path: Path) -> None:
    first, second = _run_two_ranks(WORKER, tmp_path, 180)
    assert (first["seen"], second["seen"]) == ([], [3])  # rank 1 alone learnt the alert, at step 5
    assert first["failures"] == second["failures"] == {}
    # Agreed at step 8, the first multiple of the sampling period (every=4) after the request: both ranks switch
    # there, and both record it.
    expected = ["fp4_e2m1"] * 8 + ["fp8_e4m3"] * 6
    assert first["specs"] == second["specs"] == expected
    assert first["actions"] == second["actions"] == [[8, "keep_high_precision", "2", 3]]
    assert first["formats"] == second["formats"]
    assert first["formats"]["12"][1]["weight"] == "fp8_e4m3:tensor"
    assert first["formats"]["4"][1]["weight"] == "fp4_e2m1:tensor"
    # The replicas' weights are bit-identical at every sampled step, before and after the switch.
    assert sorted(first["hashes"], key=int) == ["0", "4", "8", "12"]
    assert first["hashes"] == second["hashes"]
