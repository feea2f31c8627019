"""Weight fingerprints, the replica group and the environment a rank reports (single process; the multi-process
comparison is in tests/integrations/test_rank_consistency.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import quantwatch.agent as qw
from quantwatch.agent import fingerprint as fingerprint_module
from quantwatch.agent.environment import ENVIRONMENT_OVERRIDE_ENV, _mesh_group, environment, replica_group
from quantwatch.agent.fingerprint import weight_fingerprint
from quantwatch.agent.wire import encode_batch
from quantwatch.kernels import QuantConfig, Recipe, quantize_model
from quantwatch.service.batch import decode_json


def _print(w: torch.Tensor) -> tuple[list[float], list[int]]:
    sums, checks = weight_fingerprint(w)
    return sums.tolist(), checks.tolist()


def test_the_checksum_sees_one_flipped_bit_and_moved_rows() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 48)
    sums, checks = _print(w)
    assert _print(w.clone()) == (sums, checks)
    flipped = w.clone()
    flipped.view(torch.int32)[3, 5] ^= 1  # the last mantissa bit
    assert _print(flipped)[1][0] != checks[0]
    swapped = w[[1, 0, *range(2, 64)]]
    assert _print(swapped)[1][0] == checks[0]  # the same words ...
    assert _print(swapped)[1][1] != checks[1]  # ... in other rows
    reference = w.double().numpy()
    assert sums[0] == pytest.approx(float(reference.sum()), rel=1e-6, abs=1e-6)
    assert sums[1] == pytest.approx(float(np.square(reference).sum()), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_that_are_not_whole_words_and_narrow_dtypes(dtype: torch.dtype) -> None:
    w = torch.arange(15, dtype=torch.float32).reshape(3, 5).to(dtype)  # 5 elements: not a multiple of 8 bytes
    sums, checks = _print(w)
    assert sums == pytest.approx([105.0, float(sum(i * i for i in range(15)))], rel=1e-6)
    bumped = w.clone()
    bumped[2, 4] = 15
    assert _print(bumped)[1] != checks


def _quantized() -> nn.Module:
    torch.manual_seed(0)
    return quantize_model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), Recipe(default=QuantConfig()))


def test_a_replica_group_of_two_sends_fingerprints_that_decode_in_the_collector() -> None:
    model = _quantized()
    sink = qw.InMemoryExporter()
    with qw.attach(model, run="fp", exporter=sink, every=2, replica_group=[0, 1], metrics=["weight_rel_l2"]) as m:
        for step in range(3):
            model(torch.randn(4, 6)).sum().backward()
            m.step(step)
    records = [r for b in sink.batches for r in b.steps]
    assert [r.step for r in records] == [0, 2]
    assert records[0].environment is not None
    assert records[0].environment["torch"] == torch.__version__
    assert records[1].environment is None  # once
    for record in records:
        assert record.fingerprints is not None
        assert record.fingerprints.group == (0, 1)
    last = records[-1].fingerprints
    assert last is not None
    assert last.sum[1] == pytest.approx(float(model[2].weight.detach().double().sum()), rel=1e-6)
    batch = sink.batches[-1]
    decoded = decode_json(encode_batch(batch, "json", compress=False).body)
    (report,) = [r for r in decoded.rank_reports if r.step == 2]
    assert report.group == (0, 1)
    assert report.hash == last.hash
    assert report.sum == last.sum


def test_a_single_process_sends_its_environment_but_no_fingerprints() -> None:
    model = _quantized()
    sink = qw.InMemoryExporter()
    with qw.attach(model, run="one", exporter=sink, every=1, metrics=["weight_rel_l2"]) as monitor:
        for step in range(2):
            model(torch.randn(4, 6)).sum().backward()
            monitor.step(step)
    records = [r for b in sink.batches for r in b.steps]
    assert [r.fingerprints for r in records] == [None, None]
    assert [r.environment is not None for r in records] == [True, False]


def test_replica_group_override_is_validated() -> None:
    model = nn.Linear(2, 2)
    assert replica_group(model, 1, [3, 1, 2]) == (1, 2, 3)
    assert replica_group(model, 0) == (0,)  # no process group, WORLD_SIZE unset
    for bad in ([1, 2], "01", [0, -1], [0, True]):
        with pytest.raises(qw.ConfigError, match="replica_group"):
            replica_group(model, 0, bad)  # type: ignore[arg-type]


def test_the_replicas_of_a_shard_on_a_two_dimensional_mesh() -> None:
    # HSDP: mesh dim 0 replicates, dim 1 shards; this rank (5) sits at coordinate (1, 1) of a 2 × 4 mesh.
    Replicate, Shard = type("Replicate", (), {}), type("Shard", (), {})
    mesh = SimpleNamespace(mesh=np.arange(8).reshape(2, 4), get_coordinate=lambda: [1, 1])
    param = SimpleNamespace(device_mesh=mesh, placements=(Replicate(), Shard()))
    model: Any = SimpleNamespace(parameters=lambda: iter([param]))
    assert _mesh_group(model, 5) == (1, 5)
    fully_sharded = SimpleNamespace(device_mesh=mesh, placements=(Shard(), Shard()))
    assert _mesh_group(SimpleNamespace(parameters=lambda: iter([fully_sharded])), 5) == (5,)  # type: ignore[arg-type]


def test_the_environment_override_for_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENVIRONMENT_OVERRIDE_ENV, '{"torch": "9.9", "nccl": "1.2.3"}')
    facts = environment(torch.device("cpu"))
    assert (facts["torch"], facts["nccl"]) == ("9.9", "1.2.3")
    with qw.attach(nn.Linear(2, 2), run="x", exporter=qw.InMemoryExporter()) as monitor:
        assert monitor.layers == ()  # attach accepts a well-formed override
    monkeypatch.setenv(ENVIRONMENT_OVERRIDE_ENV, '{"torch": 9}')
    with pytest.raises(qw.ConfigError, match=ENVIRONMENT_OVERRIDE_ENV):
        qw.attach(nn.Linear(2, 2), run="x", exporter=qw.InMemoryExporter())


def test_a_weight_that_cannot_be_fingerprinted_is_left_out_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _quantized()
    unreadable = model[0].weight

    def fingerprint(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weight is unreadable:  # as a training wrapper subclass without plain bits would
            raise TypeError("no plain bits")
        return weight_fingerprint(weight)

    monkeypatch.setattr(fingerprint_module, "weight_fingerprint", fingerprint)
    sink = qw.InMemoryExporter()
    with qw.attach(model, run="c", exporter=sink, replica_group=[0, 1], metrics=["weight_rel_l2"]) as monitor:
        model(torch.randn(2, 6)).sum().backward()
        monitor.step(0)
        assert monitor.stats()["failures"] == {"fingerprint": 1}
    fingerprints = sink.batches[0].steps[0].fingerprints
    assert fingerprints is not None
    assert fingerprints.hash[0] is None
    assert fingerprints.hash[1] is not None


def test_integer_weights_are_checksummed_by_their_own_bits() -> None:
    w = torch.tensor([[2**40, 1], [3, 4]], dtype=torch.int64)
    bumped = w.clone()
    bumped[0, 0] += 1  # lost in a float32 copy, not in the bits
    assert _print(w)[1] != _print(bumped)[1]
