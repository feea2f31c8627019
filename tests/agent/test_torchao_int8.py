"""torchao INT8 mixed-precision training (real torchao 0.18 on the CPU, no mocks: without Triton its GEMM is
``torch._int_mm`` scaled by the row and column scales) against an int8 rowwise cast written here with plain torch
ops: both variants found, every figure recomputed, the layer's output rebuilt from the measured casts,
``keep_high_precision`` mid-training, the shadow model and a layer the adapter cannot read."""

from __future__ import annotations

import copy
import logging
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.adapters import torchao_int8
from quantwatch.agent.adapters.linear import high_precision_data
from quantwatch.agent.wire import encode_batch
from quantwatch.protocol import check_layer_format
from quantwatch.service.alerts.defaults import DEFAULT_RULES
from tests.agent.test_contract import _decode
from tests.agent.test_torchao_adapters import (
    attach_with_shadow,
    cosine,
    one_step,
    rel_l2,
    train,
    train_beside_shadow,
)

with warnings.catch_warnings():  # torchao's CUDA-only extensions warn on a CPU
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao")
    from torchao.prototype.quantized_training import (
        Int8MixedPrecisionTrainingConfig,
        Int8MixedPrecisionTrainingLinearWeight,
    )
    from torchao.quantization import quantize_

INT8 = {"weight": "int8:channel", "input": "int8:token", "grad": "int8:token"}
HIGH = dict.fromkeys(INT8, "high_precision")
CAST_METRICS = {"weight_rel_l2", "act_rel_l2", "grad_rel_l2"}
INPUT_CAST_METRICS = {"underflow_ratio", "overflow_ratio", "nonfinite_count", "amax", "scale"}  # of the input cast


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def int8_model(config: Int8MixedPrecisionTrainingConfig | None = None, *, swap: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    quantize_(model, config or Int8MixedPrecisionTrainingConfig(module_swap=swap))
    return model


def int8_rowwise(t: Tensor) -> tuple[Tensor, Tensor]:
    """The int8 cast of each row of ``t`` (2-D): scale amax/127, round half to even, clip to [-128, 127]."""
    scale = t.abs().amax(dim=1) / 127
    q = torch.clamp(torch.round(t / scale.clamp(min=1e-12).unsqueeze(1)), -128, 127).to(torch.int8)
    return q, scale


def dequantized(t: Tensor) -> Tensor:
    q, scale = int8_rowwise(t)
    return q.float() * scale.unsqueeze(1)


def wrapper_computes_int8() -> bool:
    """Whether this torchao's weight wrapper runs F.linear in INT8 at all (torchao 0.18's does not)."""
    weight = torch.randn(8, 8)
    x = torch.randn(4, 8)
    wrapped = Int8MixedPrecisionTrainingLinearWeight(weight, Int8MixedPrecisionTrainingConfig())
    return not torch.equal(F.linear(x, wrapped), F.linear(x, weight))


@pytest.mark.parametrize("swap", [True, False], ids=["module_swap", "weight_wrapper"])
def test_attach_finds_both_variants_with_formats_the_collector_and_the_rules_take(
    swap: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torchao_int8, "_PROBED", {})  # the wrapper is probed, and warned about, once per process
    model = int8_model(swap=swap)
    sink = qw.InMemoryExporter()
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        monitor = qw.attach(model, run="int8", exporter=sink, every=1)
        train(model, monitor, lambda: torch.randn(4, 8, 32), steps=2)
    monitor.close()
    assert [(str(i), i.adapter) for i in monitor.layers] == [(n, "torchao.int8_mixed_precision") for n in "02"]
    # torchao 0.18's weight wrapper never reaches its INT8 GEMMs: those layers are reported as what they compute.
    int8 = swap or wrapper_computes_int8()
    assert monitor.layer_formats() == [INT8 if int8 else HIGH] * 2
    assert ("does not route F.linear to its INT8 GEMMs" in caplog.text) is (not int8)
    measured = {name for _, record in sink.records() for name in record.metrics}
    assert measured == set(qw.DEFAULT_METRICS) if int8 else not measured & (CAST_METRICS | INPUT_CAST_METRICS)
    assert monitor.stats()["failures"] == {}
    # The collector decodes the formats as sent, and an 8-bit layer is watched by the fixed 5% output rule.
    decoded = _decode(encode_batch(sink.batches[0], "msgpack", False))
    assert list(decoded.layer_formats or ()) == monitor.layer_formats()
    assert all(check_layer_format(fmt) == fmt for fmt in INT8.values())
    output_rules = [r.name for r in DEFAULT_RULES if r.metric == "output_rel_l2" and r.matches_layer("0", INT8)]
    assert output_rules == ["quantwatch_output_deviation"]


def test_every_figure_is_the_layers_own_cast_and_its_output_is_their_int8_product() -> None:
    model = int8_model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="int8-figures", exporter=sink, every=1)
    capture = one_step(model, monitor, torch.randn(4, 8, 32))
    for name, features in (("0", 32), ("2", 64)):
        c = capture[name]
        x, dy = c["x"].reshape(-1, features), c["dy"].reshape(-1, c["dy"].shape[-1])
        got = {m: sink.value(m, name, 0) for m in qw.DEFAULT_METRICS}
        assert got["weight_rel_l2"] == pytest.approx(rel_l2(dequantized(c["w"]), c["w"]), rel=1e-6)
        assert got["act_rel_l2"] == pytest.approx(rel_l2(dequantized(x), x), rel=1e-6)
        assert got["grad_rel_l2"] == pytest.approx(rel_l2(dequantized(dy), dy), rel=1e-6)
        # The casts measured are those the layer computed with: its output is their INT8 product, bit for bit.
        (x_i8, x_scale), (w_i8, w_scale) = int8_rowwise(x), int8_rowwise(c["w"])
        product = torch._int_mm(x_i8, w_i8.T) * w_scale.view(-1) * x_scale.view(-1, 1)
        assert torch.equal(c["y"].reshape(-1, c["y"].shape[-1]), product + c["b"])
        reference = F.linear(c["x"], c["w"], c["b"])
        assert got["output_rel_l2"] == pytest.approx(rel_l2(c["y"], reference), rel=1e-6)
        assert got["output_cosine"] == pytest.approx(cosine(c["y"], reference), rel=1e-6)
        assert got["update_cosine"] == pytest.approx(cosine(c["dw"], dy.T @ x), rel=1e-6)
        assert got["amax"] == pytest.approx(float(x.abs().max()))
        assert got["scale"] == pytest.approx(float(x_scale.max()))
        assert got["overflow_ratio"] == 0.0
        nonzero = x != 0
        assert got["underflow_ratio"] == pytest.approx(float((x_i8[nonzero] == 0).float().mean()))
        assert 0 < got["output_rel_l2"] < 0.05  # INT8 rowwise is well inside the shipped 5% bound
    assert monitor.stats()["failures"] == {}


@pytest.mark.parametrize(
    ("flags", "formats"),
    [
        ({"grad_input": False}, {**INT8, "grad": "high_precision"}),
        ({"output": False, "grad_weight": False}, {**HIGH, "grad": "int8:token"}),
    ],
    ids=["grad_input_off", "output_and_grad_weight_off"],
)
def test_a_gemm_the_config_keeps_in_high_precision_reports_no_figure(
    flags: dict[str, bool], formats: dict[str, str]
) -> None:
    model = int8_model(Int8MixedPrecisionTrainingConfig(module_swap=True, **flags))
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="int8-hp", exporter=sink, every=1)
    assert monitor.layer_formats() == [formats] * 2
    capture = one_step(model, monitor, torch.randn(16, 32))
    c = capture["0"]
    measured = {m for _, record in sink.records() for m in record.metrics}
    kinds = {"weight_rel_l2": "weight", "act_rel_l2": "input", "grad_rel_l2": "grad"}
    assert {m for m, kind in kinds.items() if m in measured} == {
        m for m, k in kinds.items() if formats[k] != "high_precision"
    }
    if flags.get("output") is False:  # the forward GEMM in high precision: the output is the reference's
        assert sink.value("output_rel_l2", "0", 0) == pytest.approx(0.0, abs=1e-7)
    else:
        assert sink.value("output_rel_l2", "0", 0) == pytest.approx(rel_l2(c["y"], F.linear(c["x"], c["w"], c["b"])))
    assert monitor.stats()["failures"] == {}


def _metrics(sink: qw.InMemoryExporter, layer: str, step: int) -> set[str]:
    """The metrics measured for ``layer`` at ``step``."""
    return {
        metric
        for batch, record in sink.records()
        if record.step == step
        for metric, values in record.metrics.items()
        if values[batch.layers.index(layer)] is not None
    }


def test_keep_high_precision_switches_one_layer_off_and_on_again_mid_training() -> None:
    model = int8_model()
    shared = model[0].config
    assert model[2].config is shared  # quantize_ hands every layer the same config object
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="int8-switch", exporter=sink, every=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    parameters = list(model.parameters())

    def step(n: int) -> None:
        model(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(n)

    step(0)
    qw.actions.keep_high_precision("0", format=None)
    step(1)
    assert monitor.layer_formats() == [HIGH, INT8]
    assert model[2].config is shared
    assert (shared.output, shared.grad_input, shared.grad_weight) == (True,) * 3
    layer = model[0]
    x = torch.randn(16, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-6)
    step(2)
    monitor.flush()
    assert _metrics(sink, "0", 2) == set(qw.DEFAULT_METRICS) - CAST_METRICS - INPUT_CAST_METRICS
    assert sink.value("output_rel_l2", "0", 2) == pytest.approx(0.0, abs=1e-6)
    assert _metrics(sink, "2", 2) == set(qw.DEFAULT_METRICS)

    qw.actions.keep_high_precision("0", format="int8")
    qw.actions.keep_high_precision("2", format="fp8")  # refused: an INT8 training layer takes None or "int8"
    step(3)
    step(4)
    monitor.close()
    assert monitor.layer_formats() == [INT8, INT8]
    assert model[0].config is not shared
    assert model[0].config == shared
    assert _metrics(sink, "0", 4) == set(qw.DEFAULT_METRICS)
    assert sink.value("output_rel_l2", "0", 4) > 0
    assert list(model.parameters()) == parameters
    assert all(p in optimizer.state for p in parameters)
    assert monitor.stats()["failures"] == {"action_keep_high_precision": 1}


def test_the_weight_wrapper_that_never_runs_int8_refuses_to_be_switched_on() -> None:
    if wrapper_computes_int8():
        pytest.skip("this torchao's weight wrapper runs its INT8 GEMMs")
    model = int8_model(swap=False)
    monitor = qw.attach(model, run="int8-wrapper", exporter=qw.InMemoryExporter(), every=1)
    qw.actions.keep_high_precision("0", format="int8")
    monitor.step(0)
    monitor.close()
    assert monitor.stats()["failures"] == {"action_keep_high_precision": 1}
    assert monitor.layer_formats() == [HIGH, HIGH]


@pytest.mark.parametrize("swap", [True, False], ids=["module_swap", "weight_wrapper"])
def test_the_shadow_model_runs_int8_layers_in_high_precision_and_the_drift_is_measured(swap: bool) -> None:
    model = int8_model(swap=swap)
    sink = qw.InMemoryExporter()
    monitor = attach_with_shadow(model, "int8-shadow", sink)
    shadow = monitor.shadow_model
    assert shadow is not None
    weights = [high_precision_data(shadow[i].weight) for i in (0, 2)]
    x = torch.randn(8, 32)
    expected = F.linear(torch.relu(F.linear(x, weights[0], shadow[0].bias)), weights[1], shadow[2].bias)
    torch.testing.assert_close(shadow(x), expected, rtol=1e-6, atol=1e-6)
    # The model's own layers (and the config they share) still compute in INT8.
    assert torch.equal(model(x), shadow(x)) is not (swap or wrapper_computes_int8())
    assert all(getattr(layer, "config", getattr(layer.weight, "config", None)).output for layer in (model[0], model[2]))
    train_beside_shadow(model, monitor, x, lr=1e-2)
    monitor.close()
    assert sink.scalar("loss_shadow", 0) == pytest.approx(float(expected.detach().pow(2).mean()), rel=1e-6)
    # The drift compares the high-precision weights inside torchao's wrappers (numpy takes no wrapper).
    drift = rel_l2(high_precision_data(model[0].weight), high_precision_data(shadow[0].weight))
    assert sink.value("weight_drift_rel_l2", "0", 1) == pytest.approx(drift, rel=1e-5, abs=1e-12)
    assert monitor.stats()["failures"] == {}


def test_a_layer_with_a_config_the_adapter_cannot_read_is_reported_once_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = int8_model()
    # A config whose backward flags a torchao renamed: the frozen first layer runs only its forward, which reads
    # `output` alone.
    model[0].config = SimpleNamespace(output=True)
    model[0].requires_grad_(False)
    sink = qw.InMemoryExporter()
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        monitor = qw.attach(model, run="int8-unsupported", exporter=sink, every=1)
        train(model, monitor, lambda: torch.randn(8, 32), steps=2)
    messages = [r.getMessage() for r in caplog.records if "cannot be measured" in r.getMessage()]
    assert len(messages) == 1
    assert messages[0].startswith("quantwatch agent: 0 (Int8MixedPrecisionTrainingLinear)")
    assert "its config (SimpleNamespace) has no boolean grad_input, grad_weight" in messages[0]
    assert monitor.layers == ("2",)
    assert sink.value("act_rel_l2", "2", 1) is not None
    assert monitor.stats()["failures"] == {}


@pytest.mark.parametrize("checkpointed", [None, False, True], ids=["plain", "checkpoint", "reentrant_checkpoint"])
def test_the_casts_measured_are_those_the_layer_made_none_recomputed(
    checkpointed: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module-swap layer's casts are captured from its own ``_dynamic_int8_mm`` calls: a sampled step makes as
    many casts as an unsampled one, recomputes only the gradient cast of a GEMM that does not run, and every figure is
    what recomputing them all gives, bit for bit (also when activation checkpointing re-runs the forward inside the
    backward node)."""
    import torchao.prototype.quantized_training.int8 as int8_module
    import torchao.prototype.quantized_training.int8_mixed_precision as mixed
    from torch.utils.checkpoint import checkpoint

    made, recomputed = [0], [0]
    layer_cast, own_cast = mixed.quantize_int8_rowwise, int8_module.quantize_int8_rowwise
    monkeypatch.setattr(
        mixed, "quantize_int8_rowwise", lambda *a, **k: made.__setitem__(0, made[0] + 1) or layer_cast(*a, **k)
    )
    monkeypatch.setattr(
        int8_module,
        "quantize_int8_rowwise",
        lambda *a, **k: recomputed.__setitem__(0, recomputed[0] + 1) or own_cast(*a, **k),
    )
    base = int8_model()
    # A reentrant checkpoint passes gradients only to inputs that need one: then the first layer's input does too.
    inputs = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(bool(checkpointed))
    first_grad = 1 if checkpointed else 0  # whether the first layer's input-gradient GEMM runs
    figures = []
    for captured in (True, False):
        monkeypatch.setattr(torchao_int8._CAPTURE, "available", lambda captured=captured: captured)
        model = copy.deepcopy(base)
        sink = qw.InMemoryExporter()
        monitor = qw.attach(model, run=f"int8-capture-{captured}", exporter=sink, every=2)
        counts = []
        for step in range(2):  # step 0 sampled, step 1 not
            made[0] = recomputed[0] = 0
            output = model(inputs) if checkpointed is None else checkpoint(model, inputs, use_reentrant=checkpointed)
            output.pow(2).mean().backward()
            monitor.step(step)
            counts.append((made[0], recomputed[0]))
        monitor.close()
        # Two layers' input and weight per forward run (checkpointing runs it twice), and their backward GEMMs' casts:
        # output gradient and weight, input and output gradient (2 for a first layer whose input needs no gradient).
        layer_casts = 2 * 2 * (1 if checkpointed is None else 2) + 4 + 2 + 2 * first_grad
        assert counts[1] == (layer_casts, 0)
        # Captured, only the first layer's gradient cast is recomputed where its input-gradient GEMM does not run;
        # recomputed, each layer's weight, input and gradient casts, not again for a forward checkpointing re-runs.
        assert counts[0] == (layer_casts, 1 - first_grad if captured else 6)
        figures.append({(m, n): sink.value(m, n, 0) for m in CAST_METRICS | INPUT_CAST_METRICS for n in "02"})
        assert monitor.stats()["failures"] == {}
    assert all(value is not None for value in figures[0].values())
    assert figures[0] == figures[1]


def test_the_update_comparison_reads_torchaos_transposed_gradient_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao's INT8 weight gradient is ``(Xᵀ dY)ᵀ``, a transposed view: the reference is made in that layout, so the
    comparison copies neither (one copy was ~2 ms a sampled step of the bench's model)."""
    from quantwatch.agent import comparison

    read, pairs = comparison._read_in_place, []

    def spying(x: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
        a, b = read(x, q)
        pairs.append((q.is_contiguous(), a.data_ptr() == x.data_ptr() and b.data_ptr() == q.data_ptr()))
        return a, b

    monkeypatch.setattr(comparison, "_read_in_place", spying)
    model = int8_model()
    monitor = qw.attach(model, run="int8-in-place", exporter=qw.InMemoryExporter(), every=1, metrics=["update_cosine"])
    train(model, monitor, lambda: torch.randn(4, 8, 32), steps=1)
    monitor.close()
    transposed = [in_place for contiguous, in_place in pairs if not contiguous]  # the two layers' weight gradients
    assert transposed == [True, True]


def test_a_capture_listener_that_fails_is_counted_never_raised_into_training(monkeypatch: pytest.MonkeyPatch) -> None:
    # The listener runs inside torchao's cast, inside the layer's forward and backward.
    def broken(*args: Any) -> None:
        raise RuntimeError("a renamed torchao attribute")

    monkeypatch.setattr(torchao_int8._CapturedInt8Linear, "_on_captured", broken)
    model = int8_model()
    monitor = qw.attach(model, run="int8-broken-listener", exporter=qw.InMemoryExporter(), every=1)
    train(model, monitor, lambda: torch.randn(4, 8, 32), steps=2)
    monitor.close()
    assert monitor.stats()["failures"].get("cast_stats_failed", 0) > 0
