"""The torchao float8 adapter's recomputed casts (a torchao whose casts cannot be captured, ``Float8TrainingOpConfig``'s
weight wrapper): their statistics from one native pass, bit for bit those of the dequantized tensors and of torchao's
own dequantization, and the same figures as the captured casts'."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import quantwatch.agent as qw

with warnings.catch_warnings():  # torchao's CUDA-only extensions warn on a CPU
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao")
    import torchao.float8.float8_scaling_utils as scaling_utils
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from quantwatch.agent.adapters import torchao_float8
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_WEIGHT
from quantwatch.kernels import native
from quantwatch.kernels.stats import stats_from_masks


def float8_model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config)
    return model


def bits(t: Tensor) -> Tensor:
    return t.nan_to_num(-1.0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_recomputed_casts_statistics_are_its_dequantized_tensors_and_torchaos_own(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    native.available()  # loaded (where it builds): the statistics then take its one pass, compared below
    layer: Any = float8_model(recipe)[0]
    made: list[Any] = []  # torchao's own cast of each recomputation
    original = scaling_utils.hp_tensor_to_float8_dynamic
    monkeypatch.setattr(
        scaling_utils, "hp_tensor_to_float8_dynamic", lambda *a, **k: made.append(original(*a, **k)) or made[-1]
    )
    casts = torchao_float8._casts(layer.config, layer.linear_mm_config)
    generator = torch.Generator().manual_seed(0)
    native_passes = 0
    for trial in range(12):
        tensors = {
            KIND_WEIGHT: torch.randn(48, 32, generator=generator),
            KIND_INPUT: torch.randn(4, 8, 32, generator=generator) * 10.0 ** (trial % 5 - 2),
            KIND_GRAD: torch.randn(4, 8, 48, generator=generator) * 1e-3,
        }
        if trial % 4 == 3:  # a NaN/±inf: the native pass declines, the tensors' way measures
            tensors[KIND_INPUT][1, 2, 3] = (float("nan"), float("inf"), -float("inf"))[trial % 3]
        for kind, t in tensors.items():
            result = casts[kind](t)
            fp8 = made[-1]
            got = result.stats().as_tensor()
            # The tensors' way, from the tensors the result makes when read.
            assert torch.equal(
                bits(got), bits(stats_from_masks(result.hp, result.dequantized, result.overflow).as_tensor())
            )
            # torchao's own dequantization, in the layout measured (W for the weight's Wᵀ), and the full mask.
            dequantized = fp8.to_original_precision()
            scale = fp8._scale
            if kind == KIND_WEIGHT:
                dequantized, scale = dequantized.t(), scale.t() if scale.dim() == 2 else scale
            hp = t if kind != KIND_GRAD else t.reshape(-1, 48)
            mask = (hp * scale).abs() > torch.finfo(fp8._data.dtype).max
            assert torch.equal(bits(got), bits(stats_from_masks(hp, dequantized, mask).as_tensor()))
            assert result.scale is not None
            assert torch.equal(bits(result.scale), bits((1.0 / fp8._scale.to(torch.float32)).amax()))
            native_passes += torch.isfinite(t).all().item()
    assert native_passes > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_recomputed_casts_report_the_captured_casts_figures(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = float8_model(recipe)
    figures = []
    recomputed = []
    measure = torchao_float8._RecomputedCast.stats
    monkeypatch.setattr(torchao_float8._RecomputedCast, "stats", lambda self: recomputed.append(1) or measure(self))
    for captured in (True, False):
        monkeypatch.setattr(torchao_float8._CAPTURE, "available", lambda captured=captured: captured)
        recomputed.clear()
        model = copy.deepcopy(base)
        sink = qw.InMemoryExporter()
        monitor = qw.attach(model, run=f"f8-{captured}", exporter=sink, every=1)
        inputs = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
        model(inputs).pow(2).mean().backward()
        monitor.step(0)
        monitor.flush()
        metrics = ("weight_rel_l2", "act_rel_l2", "grad_rel_l2", "amax", "scale", "overflow_ratio")
        figures.append({(m, name): sink.value(m, name, 0) for m in metrics for name in ("0", "2")})
        assert len(recomputed) == (0 if captured else 6)  # two layers' weight, input and gradient casts
        assert monitor.stats()["failures"] == {}
        monitor.close()
    assert all(value is not None for value in figures[0].values())
    assert figures[0] == figures[1]  # exactly: the same casts, the same statistics
