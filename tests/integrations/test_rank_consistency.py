"""Replicas that must agree, checked end to end: gloo DDP processes on CPU post to a real collector on loopback; one
rank perturbs one layer's weights after step 5, and the collector names that layer (and rank) at the next sampled
step, while a run of identical replicas never fires. Ranks also report their environment (one claims another torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from quantwatch.service.server import BackgroundServer
from tests.agent.test_distributed import _free_port

WORKER = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    import quantwatch.agent as qw
    from quantwatch.kernels import QuantConfig, Recipe, quantize_model

    rank, world, port, url, perturbed, prefix = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                 int(sys.argv[5]), sys.argv[6])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return DistributedDataParallel(quantize_model(model, Recipe(default=QuantConfig())))

    perturbed_model, same_model = build(), build()
    options = dict(every=5, metrics=["output_rel_l2"], spool_max_bytes=0, ranks="first")
    runs = [  # the DDP wrapper's group is detected; the inner module's is the world's
        (perturbed_model, qw.attach(perturbed_model, run=f"{prefix}-perturbed", url=url, **options)),
        (same_model, qw.attach(same_model.module, run=f"{prefix}-same", url=url, **options)),
    ]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model, _ in runs]
    generator = torch.Generator().manual_seed(rank)
    for step in range(12):
        x = torch.randn(4, 8, generator=generator)
        for (model, monitor), optimizer in zip(runs, optimizers):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(step)
        if step == 5 and rank == perturbed:
            with torch.no_grad():
                perturbed_model.module[2].weight[0, 0] += 1e-3
    for _, monitor in runs:
        assert monitor.close(30)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it (pytorch/pytorch#190489)
    """
)


def _train(tmp_path: Path, collector: BackgroundServer, world: int, perturbed: int, prefix: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.pop("QUANTWATCH_ENV_OVERRIDE", None)
        if world == 2 and rank == 1:
            env["QUANTWATCH_ENV_OVERRIDE"] = json.dumps({"torch": "9.9"})
        args = [str(rank), str(world), port, collector.url, str(perturbed), prefix]
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err


def _mismatch_episodes(collector: BackgroundServer, run: str) -> list[dict[str, Any]]:
    alerts = httpx.get(f"{collector.url}/api/v1/alerts", params={"run": run}, timeout=10).json()
    return [a for a in alerts if a["rule"] == "quantwatch_rank_weight_mismatch"]


def _ranks(collector: BackgroundServer, run: str) -> dict[str, Any]:
    answer = httpx.get(f"{collector.url}/api/v1/runs/{run}/ranks", timeout=10)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


@pytest.mark.parametrize(("world", "perturbed"), [(2, 1), (3, 2)])
def test_a_perturbed_replica_is_named_at_the_next_sampled_step(
    tmp_path: Path, sqlite_collector: BackgroundServer, world: int, perturbed: int
) -> None:
    prefix = f"ddp{world}"
    _train(tmp_path, sqlite_collector, world, perturbed, prefix)

    (episode,) = _mismatch_episodes(sqlite_collector, f"{prefix}-perturbed")
    assert episode["layer"] == "2"  # named as in the bare model, without DDP's module.
    assert episode["firing"]["step"] == 10  # sampled steps are 0, 5, 10: the first after the change
    assert episode["ranks"] == [perturbed]
    answer = _ranks(sqlite_collector, f"{prefix}-perturbed")
    assert (answer["compared_steps"], answer["incomplete_steps"], answer["mismatched_steps"]) == (3, 0, 1)
    (mismatch,) = answer["mismatches"]
    assert (mismatch["step"], mismatch["layer"], mismatch["ranks"]) == (10, "2", [perturbed])
    assert mismatch["majority"] is (world == 3)
    assert [r["group"] for r in answer["ranks"]] == [f"0-{world - 1}"] * world

    assert _mismatch_episodes(sqlite_collector, f"{prefix}-same") == []
    same = _ranks(sqlite_collector, f"{prefix}-same")
    assert (same["compared_steps"], same["mismatched_steps"]) == (3, 0)

    if world == 2:  # rank 1 claims torch 9.9
        assert answer["environment_consistent"] is False
        assert answer["differing_fields"] == ["torch"]
        assert answer["ranks"][1]["environment"]["torch"] == "9.9"
    else:
        assert answer["environment_consistent"] is True
        assert answer["differing_fields"] == []
