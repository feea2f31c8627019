"""The reference's precision: FP32 with autocast off by default, BF16 autocast with ``reference_dtype="bfloat16"``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.shadow import run_reference
from quantwatch.kernels import QuantLinear


def _rel_l2(q: Tensor, x: Tensor) -> float:
    return float(torch.linalg.vector_norm((q - x).double()) / torch.linalg.vector_norm(x.double()))


def _autocast_step(reference_dtype: Any) -> tuple[float, dict[str, Tensor], qw.Monitor]:
    torch.manual_seed(0)
    model = nn.Sequential(QuantLinear(64, 32))
    seen: dict[str, Tensor] = {}
    model[0].register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), y=o.detach()))
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="precision", exporter=sink, every=1, reference_dtype=reference_dtype)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().sum().backward()
    monitor.step()
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    assert sink.value("update_cosine", "0", 0) is not None
    value = sink.value("output_rel_l2", "0", 0)
    assert value is not None
    seen.update(w=model[0].weight.detach(), b=model[0].bias.detach())
    return value, seen, monitor


def test_under_bf16_autocast_the_default_reference_is_fp32_with_autocast_off() -> None:
    value, seen, _ = _autocast_step("float32")
    assert seen["y"].dtype == torch.bfloat16  # the quantized layer's matmul ran in BF16 under autocast
    reference = F.linear(seen["x"].float(), seen["w"], seen["b"])  # outside autocast: float32
    assert value == pytest.approx(_rel_l2(seen["y"].float(), reference), rel=1e-4)


def test_reference_dtype_bfloat16_compares_with_the_bf16_autocast_baseline() -> None:
    value, seen, _ = _autocast_step("bfloat16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = F.linear(seen["x"], seen["w"], seen["b"])
    assert reference.dtype == torch.bfloat16
    assert value == pytest.approx(_rel_l2(seen["y"].float(), reference.float()), rel=1e-4)
    fp32_value, _, _ = _autocast_step("float32")
    assert value != pytest.approx(fp32_value, rel=1e-3)  # the two baselines differ by the BF16 matmul's rounding


def test_run_reference_switches_autocast_off_and_casts_to_float32() -> None:
    w = torch.randn(4, 8)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32 = run_reference(lambda t: t @ w.T, x)
        bf16 = run_reference(lambda t: t @ w.T, x.float(), dtype=torch.bfloat16)
    assert fp32.dtype == torch.float32
    assert torch.equal(fp32, x.float() @ w.T)
    assert bf16.dtype == torch.bfloat16
