"""``qw.actions.keep_high_precision`` on every kind of layer an adapter measures, with real torchao 0.18 on the CPU
(emulated float8 GEMMs, ``KernelPreference.EMULATED`` MX kernels): switched off, a layer computes ``F.linear`` with
its own weights, forward and backward; switched to a format, what torchao's own layer of that format computes, and
the monitor measures it as it measures that layer.  The parameters stay the objects the optimizer holds, with their
state.  NVFP4 layers need a CUDA GPU with NVFP4 kernels to run quantized: here they are switched before their first
forward (which then runs on the CPU)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.adapters.discovery import layer_formats
from quantwatch.agent.adapters.linear import high_precision_data, runs_plain_linear
from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model

with warnings.catch_warnings():  # torchao's CUDA-only extensions warn on a CPU
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
    from torchao.prototype.qat import MXFakeQuantizeConfig, NVFP4FakeQuantizeConfig
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

HIGH = {"weight": "high_precision", "input": "high_precision", "grad": "high_precision"}
TOKENS, IN, OUT = 32, 64, 32  # MX blocks of 32 along every GEMM's inner dimension, the tokens included


def _qat(weight: Any, activation: Any) -> Callable[[nn.Module], object]:
    return lambda m: quantize_(m, QATConfig(activation_config=activation, weight_config=weight, step="prepare"))


def _float8(recipe: str) -> Callable[[nn.Module], object]:
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return lambda m: convert_to_float8_training(m, config=config)


MX8 = MXFakeQuantizeConfig(dtype=torch.float8_e4m3fn)  # EMULATED kernels by default: runs on a CPU
INT8_TOKEN = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
CONVERT: dict[str, Callable[[nn.Module], object]] = {
    "float8": _float8("tensorwise"),
    "qat": _qat(IntxFakeQuantizeConfig(torch.int4, group_size=32), INT8_TOKEN),
    "mx_qat": _qat(MX8, MX8),
    "nvfp4_qat": _qat(NVFP4FakeQuantizeConfig(), NVFP4FakeQuantizeConfig()),
    "mxfp8": lambda m: quantize_(m, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)),
    "nvfp4": lambda m: quantize_(m, NVFP4TrainingConfig()),
}
NEEDS_GPU = {"nvfp4_qat", "nvfp4"}


def _model(kind: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, OUT))
    CONVERT[kind](model)
    return model


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _switched(kind: str, fmt: str | None) -> tuple[nn.Sequential, qw.Monitor, qw.InMemoryExporter, Any]:
    """A one-layer model of ``kind`` trained with Adam for a step (unless it needs a GPU), its layer switched to
    ``fmt`` at the end of step 0."""
    model = _model(kind)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run=f"{kind}-{fmt}", exporter=sink, every=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if kind not in NEEDS_GPU:
        _train_step(model, optimizer, torch.randn(TOKENS, IN))
    qw.actions.keep_high_precision("0", format=fmt)
    monitor.step(0)
    return model, monitor, sink, optimizer


def _metrics(sink: qw.InMemoryExporter, step: int) -> dict[str, float | None]:
    return {m: v[0] for batch, r in sink.records() if r.step == step and r.metrics for m, v in r.metrics.items()}


def _details(sink: qw.InMemoryExporter) -> list[str]:
    return [action.detail for batch in sink.batches for action in batch.actions]


def _check_same_parameters_step(model: nn.Module, optimizer: torch.optim.Optimizer, before: list[Tensor]) -> None:
    """The optimizer holds the module's very parameters, has state for the weight, and moved it."""
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    weight = model[0].weight
    assert optimizer.state[weight]["exp_avg"].shape == weight.shape
    assert not torch.equal(high_precision_data(weight).detach(), before[0])


@pytest.mark.parametrize("kind", list(CONVERT))
def test_switched_off_a_layer_runs_f_linear_on_its_own_weights_forward_and_backward(kind: str) -> None:
    model, monitor, sink, optimizer = _switched(kind, None)
    layer = model[0]
    assert monitor.layer_formats() == [HIGH]
    parameters = [high_precision_data(p).detach().clone() for p in layer.parameters()]
    weight, bias = (p.clone().requires_grad_() for p in parameters)
    x = torch.randn(TOKENS, IN)
    y = layer(x)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(high_precision_data(layer.weight.grad), weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(high_precision_data(layer.bias.grad), bias.grad, rtol=1e-5, atol=1e-6)
    optimizer.step()
    optimizer.zero_grad()
    _check_same_parameters_step(model, optimizer, parameters)
    monitor.step(1)
    monitor.close()
    [detail] = _details(sink)
    assert all(change.endswith("→ high_precision") for change in detail.split("; "))
    # Measured as a high-precision layer: output and update against the FP32 reference, no cast figures.
    measured = _metrics(sink, 1)
    assert measured["output_rel_l2"] == pytest.approx(0.0, abs=1e-6)
    assert measured["update_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert not {"weight_rel_l2", "act_rel_l2", "grad_rel_l2"} & measured.keys()
    assert monitor.stats()["failures"] == {}


def _plain_linear_like(layer: nn.Module) -> nn.Sequential:
    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(IN, OUT))
    with torch.no_grad():
        plain[0].weight.copy_(high_precision_data(layer.weight))
        plain[0].bias.copy_(high_precision_data(layer.bias))
    return plain


SWITCHES = [  # (kind, format, how torchao's own layer of that format is made)
    ("float8", "fp8:rowwise", _float8("rowwise")),
    ("mxfp8", "fp8", _float8("tensorwise")),
    ("nvfp4", "fp8:rowwise_with_gw_hp", _float8("rowwise_with_gw_hp")),
    ("qat", "int8", _qat(IntxFakeQuantizeConfig(torch.int8, "per_channel"), INT8_TOKEN)),
    ("mx_qat", "mxfp4", _qat(MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2), MXFakeQuantizeConfig())),
]


@pytest.mark.parametrize(("kind", "fmt", "convert"), SWITCHES, ids=[f"{k}-{f}" for k, f, _ in SWITCHES])
def test_switched_to_a_format_a_layer_computes_and_is_measured_as_torchaos_layer_of_it(
    kind: str, fmt: str, convert: Callable[[nn.Module], object]
) -> None:
    model, monitor, sink, optimizer = _switched(kind, fmt)
    layer = model[0]
    own = _plain_linear_like(layer)
    convert(own)
    assert monitor.layer_formats() == [layer_formats("0", own[0])]
    assert monitor.layer_formats() != [HIGH]
    x = torch.randn(TOKENS, IN)
    assert torch.equal(layer(x), own(x))

    # The next step, measured on both: the same figures.
    own_sink = qw.InMemoryExporter()
    own_monitor = qw.attach(own, run="own", exporter=own_sink, every=1)
    before = [high_precision_data(p).detach().clone() for p in layer.parameters()]
    _train_step(model, optimizer, x)
    _train_step(own, torch.optim.Adam(own.parameters(), lr=1e-2), x)
    _check_same_parameters_step(model, optimizer, before)
    monitor.step(1)
    own_monitor.step(0)
    monitor.close()
    own_monitor.close()
    measured, expected = _metrics(sink, 1), _metrics(own_sink, 0)
    assert measured.keys() == expected.keys()
    assert "weight_rel_l2" in measured
    for metric, value in expected.items():
        assert measured[metric] == pytest.approx(value, rel=1e-5, abs=1e-7), metric
    assert monitor.stats()["failures"] == {}


def test_a_switch_a_layer_cannot_take_is_a_recorded_failure_and_the_other_layers_are_switched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    first, rest = nn.Sequential(nn.Linear(16, 32)), nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 16))
    _float8("tensorwise")(first)
    _qat(IntxFakeQuantizeConfig(torch.int4, group_size=16), None)(rest)
    model = nn.Sequential(first[0], *rest)  # "1" has 32 inputs: groups of 32 fit; "2" has 16: they do not
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="refused", exporter=sink, every=1)
    kept = model[2].weight_fake_quantizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    qw.actions.keep_high_precision("*", format="int4")
    for step in range(2):
        _train_step(model, optimizer, torch.randn(4, 16))
        monitor.step(step)
    monitor.close()
    formats = dict(zip(map(str, monitor.layers), monitor.layer_formats(), strict=True))
    assert formats["0"]["weight"] == "fp8_e4m3:tensor"  # unchanged
    assert formats["1"]["weight"] == "int4:group32"
    assert formats["2"]["weight"] == "int4:group16"
    assert model[2].weight_fake_quantizer is kept
    assert [a.layer for b in sink.batches for a in b.actions] == ["1"]
    assert monitor.stats()["failures"] == {"action_keep_high_precision": 2}
    assert "layer '0' (Float8Linear) not switched to format='int4'" in caplog.text

    quantwatch = quantize_model(nn.Sequential(nn.Linear(8, 8)), Recipe(default=QuantConfig(weight=QuantSpec("int8"))))
    monitor = qw.attach(quantwatch, run="refused-own", exporter=qw.InMemoryExporter(), every=1)
    qw.actions.keep_high_precision("0", format="fp8:rowwise")
    monitor.step(0)
    monitor.close()
    assert monitor.stats()["failures"] == {"action_keep_high_precision": 1}
    assert monitor.layer_formats()[0]["weight"] == "int8:tensor"


def test_a_layer_switched_off_is_switched_on_again_by_its_own_format(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    model, monitor, sink, _ = _switched("mxfp8", None)
    assert runs_plain_linear(model[0])
    qw.actions.keep_high_precision("0", format="mxfp8")
    monitor.step(1)
    monitor.close()
    assert not runs_plain_linear(model[0])
    assert monitor.layer_formats() == [{"weight": "mxfp8", "input": "mxfp8", "grad": "mxfp8"}]
    assert _details(sink)[-1] == "; ".join(f"{kind} high_precision → mxfp8" for kind in ("weight", "input", "grad"))
    assert caplog.text == ""


@pytest.mark.parametrize("fmt", ["fp9", "fp8:colwise", 8])
def test_a_format_no_layer_takes_is_a_config_error_at_the_call(fmt: Any) -> None:
    monitor = qw.attach(_model("float8"), run="bad-format", exporter=qw.InMemoryExporter(), every=1)
    with pytest.raises(qw.ConfigError, match="format"):
        qw.actions.keep_high_precision("0", format=fmt)
    monitor.close()
