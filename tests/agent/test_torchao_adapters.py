"""The torchao adapters against torchao's own quantizers, recomputed here (real torchao 0.18 on the CPU, no mocks):
float8 training (emulated), QAT fake quantizers, MXFP8 training (emulated kernels) and the MX / NVFP4 layers that
need a GPU to run (recognised, formats reported)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.adapters.linear import high_precision_data
from quantwatch.agent.precision import _float8_op_config
from quantwatch.protocol import check_layer_format

with warnings.catch_warnings():  # torchao's CUDA-only extensions warn on a CPU
    warnings.simplefilter("ignore")
    torchao = pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import CastConfig, ScalingType
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole
    from torchao.prototype.moe_training.config import (
        Float8TrainingOpConfig,
        MXFP8TrainingOpConfig,
        MXFP8TrainingRecipe,
    )
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerRow, PerTensor
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig, QATConfig

DEFAULT = set(qw.DEFAULT_METRICS)


def rel_l2(q: Tensor, x: Tensor) -> float:
    return float((q.double() - x.double()).norm() / x.double().norm())


def cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def one_step(model: nn.Module, monitor: qw.Monitor, inputs: Tensor, watched: type | None = None) -> dict[str, Any]:
    """Forward, backward and optimizer step at step 0, capturing each monitored layer's input, output, output
    gradient, weight, bias and weight gradient (before the optimizer moves them)."""
    capture: dict[str, dict[str, Tensor]] = {}
    handles = []
    names = {str(n) for n in monitor.layers}
    for name, module in model.named_modules():
        if name in names:

            def save(m: nn.Module, args: tuple[Tensor, ...], out: Tensor, name: str = name) -> None:
                weight = getattr(m.weight, "_data", m.weight)
                bias = getattr(m, "bias", None)
                bias = getattr(bias, "_data", bias)
                capture[name] = {"x": args[0].detach().clone(), "y": out.detach().clone(), "w": weight.detach().clone()}
                if bias is not None:
                    capture[name]["b"] = bias.detach().clone()
                out.register_hook(lambda g: capture[name].__setitem__("dy", g.detach().clone()))

            handles.append(module.register_forward_hook(save))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(inputs).pow(2).mean().backward()
    for name, module in model.named_modules():
        if name in capture:
            capture[name]["dw"] = module.weight.grad.detach().clone()
    opt.step()
    opt.zero_grad()
    monitor.step(0)
    monitor.flush()
    for h in handles:
        h.remove()
    return capture


def train(model: nn.Module, monitor: qw.Monitor, make_input: Callable[[], Tensor], steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(steps):
        loss = model(make_input()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, loss=loss)
    monitor.flush()


def attach_with_shadow(model: nn.Module, run: str, sink: qw.InMemoryExporter, lr: float = 1e-2) -> qw.Monitor:
    """``attach`` every step with the FP32 shadow model (SGD at ``lr``), measuring ``weight_drift_rel_l2`` only."""
    return qw.attach(
        model,
        run=run,
        exporter=sink,
        every=1,
        shadow="model",
        shadow_optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        metrics=["weight_drift_rel_l2"],
    )


def train_beside_shadow(model: nn.Module, monitor: qw.Monitor, x: Tensor, lr: float, steps: int = 2) -> None:
    """``steps`` SGD steps of ``model`` on the loss ``mean(model(x)²)``, the shadow model stepping on its own."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(step, loss=loss, shadow_closure=lambda m: m(x).pow(2).mean())


def float8_model(recipe: str | Float8LinearConfig, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=bias), nn.ReLU(), nn.Linear(64, 16, bias=bias))
    config = Float8LinearConfig.from_recipe_name(recipe) if isinstance(recipe, str) else recipe
    convert_to_float8_training(model, config=dataclasses.replace(config, emulate=True))
    return model


def torchao_cast(layer: Float8Linear, t: Tensor, cast: CastConfig, role: GemmInputRole, dim: int) -> Any:
    return hp_tensor_to_float8_dynamic(
        t,
        cast.target_dtype,
        layer.linear_mm_config,
        gemm_input_role=role,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(dim, cast.scaling_granularity),
        round_scales_to_power_of_2=layer.config.round_scales_to_power_of_2,
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_figures_are_the_layers_own_casts(recipe: str) -> None:
    model = float8_model(recipe)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="f8", exporter=sink, every=1)
    capture = one_step(model, monitor, torch.randn(4, 8, 32))
    for name in ("0", "2"):
        layer, c = model[int(name)], capture[name]
        config = layer.config
        wq = torchao_cast(layer, c["w"].t(), config.cast_config_weight, GemmInputRole.WEIGHT, 0)
        xq = torchao_cast(layer, c["x"], config.cast_config_input, GemmInputRole.INPUT, -1)
        dy = c["dy"].reshape(-1, c["dy"].shape[-1])
        gq = torchao_cast(layer, dy, config.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1)
        # The recomputed casts are the layer's own: its (emulated) forward is their matmul, bit for bit.
        assert torch.equal(c["y"], (xq.to_original_precision() @ wq.to_original_precision()) + c["b"])
        got = {m: sink.value(m, name, 0) for m in DEFAULT}
        assert got["weight_rel_l2"] == pytest.approx(rel_l2(wq.to_original_precision(), c["w"].t()), rel=1e-6)
        assert got["act_rel_l2"] == pytest.approx(rel_l2(xq.to_original_precision(), c["x"]), rel=1e-6)
        assert got["grad_rel_l2"] == pytest.approx(rel_l2(gq.to_original_precision(), dy), rel=1e-6)
        reference = F.linear(c["x"], c["w"], c["b"])
        assert got["output_rel_l2"] == pytest.approx(rel_l2(c["y"], reference), rel=1e-6)
        assert got["output_cosine"] == pytest.approx(cosine(c["y"], reference), rel=1e-6)
        reference_dw = dy.T @ c["x"].reshape(-1, 32 if name == "0" else 64)
        assert got["update_cosine"] == pytest.approx(cosine(c["dw"], reference_dw), rel=1e-6)
        assert got["amax"] == pytest.approx(float(c["x"].abs().max()))
        assert got["scale"] == pytest.approx(float((1 / xq._scale).max()))
        assert got["overflow_ratio"] == 0.0
    assert monitor.stats()["failures"] == {}
    if recipe == "rowwise_with_gw_hp":  # the weight-gradient GEMM is in high precision: the update is exact
        assert sink.value("update_cosine", "0", 0) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_float8_overflow_mask_is_the_clipped_elements_found_first_from_the_largest(granularity: str) -> None:
    from quantwatch.agent.adapters.torchao_float8 import _cast_result, _cast_stats
    from quantwatch.kernels import native
    from quantwatch.kernels.stats import stats_from_masks

    native.available()  # loaded (where it builds): the cast statistics then take its one pass, compared below

    config = Float8LinearConfig.from_recipe_name(granularity)
    cast, layer = config.cast_config_input, float8_model(granularity)[0]
    fmax = torch.finfo(cast.target_dtype).max
    generator = torch.Generator().manual_seed(0)
    branches = {"none clipped": 0, "mask": 0}
    for trial in range(60):
        hp = torch.randn(48, 40, generator=generator) * 10.0 ** (trial % 7 - 3)
        if trial % 10 == 9:
            hp[3, 5] = (float("nan"), float("inf"), -float("inf"))[trial % 3]
        for t, dim in ((hp, -1), (hp.t(), 0)):  # as cast, and a transposed weight as torchao casts Wᵀ
            fp8 = torchao_cast(layer, t, cast, GemmInputRole.INPUT, dim)
            result = _cast_result(t, fp8, fmax)
            scale = fp8._scale.t() if result.hp is not t and fp8._scale.dim() == 2 else fp8._scale
            expected = (result.hp * scale).abs() > fmax
            got = torch.zeros_like(expected) if result.overflow is None else result.overflow
            assert torch.equal(got, expected)
            branches["none clipped" if result.overflow is None else "mask"] += 1
            # The figures are those of the full mask (the statistics count no overflow for None as for no element).
            got_stats = result.stats().as_tensor()
            want = stats_from_masks(result.hp, result.dequantized, expected).as_tensor()
            assert torch.equal(got_stats.nan_to_num(-1.0), want.nan_to_num(-1.0))
            # What the adapter records: the same figures, bit for bit, where one native pass computes them.
            fused, fused_scale = _cast_stats(t, fp8, fmax, True)
            assert torch.equal(fused.as_tensor().nan_to_num(-1.0), got_stats.nan_to_num(-1.0))
            assert fused_scale is not None
            assert result.scale is not None
            assert torch.equal(fused_scale.nan_to_num(-1.0), result.scale.nan_to_num(-1.0))
            # torchao's own dequantization of its cast is what the tensors' way compares with x (over W for Wᵀ).
            torchao_dequantized = fp8.to_original_precision()
            if result.hp is not t:
                torchao_dequantized = torchao_dequantized.t()
            torch.testing.assert_close(result.dequantized, torchao_dequantized, rtol=0, atol=0, equal_nan=True)
            # In a training step the cast's input requires grad (torchao's Wᵀ a view of the weight): the same bits,
            # and nothing of the measurement enters the graph.
            tracked = t.detach().clone().requires_grad_() if dim == -1 else hp.detach().clone().requires_grad_().t()
            in_graph, in_graph_scale = _cast_stats(tracked, fp8, fmax, True)
            assert torch.equal(in_graph.as_tensor().nan_to_num(-1.0), got_stats.nan_to_num(-1.0))
            assert in_graph_scale is not None
            assert in_graph_scale.grad_fn is None
            assert torch.equal(in_graph_scale.nan_to_num(-1.0), fused_scale.nan_to_num(-1.0))
    if granularity == "tensorwise":  # both ways taken: rounding at the largest value does clip some
        assert min(branches.values()) > 0, branches


def test_float8_reported_scale_is_one_over_torchaos_scale_bit_for_bit() -> None:
    from quantwatch.agent.adapters.torchao_float8 import _reported_scale

    generator = torch.Generator().manual_seed(0)
    # Every exponent of float32 (subnormals included), random mantissas, both signs, and the special values.
    exponents = torch.randint(-150, 128, (4000,), generator=generator).to(torch.float64)
    values = (1 + torch.rand(4000, generator=generator, dtype=torch.float64)) * torch.exp2(exponents)
    values = torch.cat([values, -values[:500], torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    scales = values.to(torch.float32)
    for scale in scales:  # tensorwise: one scale, 0-dim as torchao makes it
        want = (1.0 / scale.to(torch.float32)).amax()
        got = _reported_scale(scale)
        assert got.shape == want.shape == ()
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)) or bool(got.isnan() & want.isnan())
    for shape in ((4000 + 505, 1), (1, 4000 + 505)):  # rowwise, as the input's and Wᵀ's scales
        rowwise = scales.reshape(shape)
        want = (1.0 / rowwise.to(torch.float32)).amax()
        assert torch.equal(_reported_scale(rowwise).nan_to_num(-1.0), want.nan_to_num(-1.0))
        finite = rowwise[rowwise.isfinite() & (rowwise != 0)].reshape(shape[0] and -1, 1)
        assert torch.equal(_reported_scale(finite), (1.0 / finite).amax())
    low = scales[scales.isfinite()][:64].to(torch.bfloat16)  # another dtype: converted first, as before
    assert torch.equal(_reported_scale(low.reshape(-1, 1)), (1.0 / low.reshape(-1, 1).to(torch.float32)).amax())


@pytest.mark.parametrize("captured", [True, False], ids=["captured", "recomputed"])
def test_float8_casts_under_activation_checkpointing_are_those_of_the_plain_run(
    captured: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The forward checkpointing re-runs inside the backward stopped before its forward hook, and the capture's
    # forward listener then took the backward node's casts: the last layer's grad_rel_l2 was never reported.
    from torch.utils.checkpoint import checkpoint

    from quantwatch.agent.adapters import torchao_float8

    monkeypatch.setattr(torchao_float8._CAPTURE, "available", lambda: captured)
    base = float8_model("tensorwise")
    figures = {}
    for mode in ("plain", "checkpoint", "reentrant_checkpoint"):
        model = copy.deepcopy(base)
        sink = qw.InMemoryExporter()
        monitor = qw.attach(model, run=f"f8-{mode}", exporter=sink, every=1, metrics=sorted(CHECKPOINTED))
        # A reentrant checkpoint passes gradients only when an input needs one.
        x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(
            mode == "reentrant_checkpoint"
        )
        out = model(x) if mode == "plain" else checkpoint(model, x, use_reentrant=mode == "reentrant_checkpoint")
        out.pow(2).mean().backward()
        monitor.step(0)
        monitor.close()
        figures[mode] = {(m, n): sink.value(m, n, 0) for m in CHECKPOINTED for n in ("0", "2")}
        assert monitor.stats()["failures"] == {}
    assert all(value is not None for value in figures["plain"].values())
    for mode in ("checkpoint", "reentrant_checkpoint"):  # the same casts (statistics summed on another path or not)
        assert figures[mode] == pytest.approx(figures["plain"], rel=1e-6), mode


CHECKPOINTED = {"weight_rel_l2", "act_rel_l2", "grad_rel_l2"}


@pytest.mark.parametrize("kind", ["float8", "float8_recomputed", "mxfp8"])
def test_scale_is_reported_on_the_sampled_steps_of_a_sparse_schedule(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The monitor reads `scale` after disarming the step's adapters: their disarm cleared it, so at every > 1 (the
    # defaults) no torchao layer ever sent one.
    from quantwatch.agent.adapters import torchao_float8

    if kind == "float8_recomputed":
        monkeypatch.setattr(torchao_float8._CAPTURE, "available", lambda: False)
    model = mxfp8_model(bias=False) if kind == "mxfp8" else float8_model("tensorwise")
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run=f"scale-{kind}", exporter=sink, every=2, metrics=["scale", "act_rel_l2"])
    train(model, monitor, lambda: torch.randn(32, 64) if kind == "mxfp8" else torch.randn(4, 8, 32), steps=3)
    monitor.close()
    assert [record.step for _, record in sink.records() if record.metrics] == [0, 2]
    for step in (0, 2):
        scales = [sink.value("scale", name, step) for name in ("0", "2")]
        assert all(value is not None and math.isfinite(value) and value > 0 for value in scales), (step, scales)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp"])
def test_float8_casts_are_measured_as_the_layer_makes_them_not_made_again(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchao.float8.float8_linear as float8_linear
    import torchao.float8.float8_scaling_utils as scaling_utils

    casts: list[int] = []
    cast = scaling_utils.hp_tensor_and_scale_to_float8  # every float8 cast of torchao's, the layer's or anyone's
    monkeypatch.setattr(
        scaling_utils, "hp_tensor_and_scale_to_float8", lambda *a, **k: casts.append(1) or cast(*a, **k)
    )
    from quantwatch.agent.adapters.torchao_float8 import _CAPTURE

    torchao_function = scaling_utils.hp_tensor_to_float8_dynamic
    listening = _CAPTURE.listening  # monitors of earlier tests, never closed, may still listen
    model = float8_model(recipe)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="f8-casts", exporter=sink, every=2)
    per_step = []
    for step in range(3):
        casts.clear()
        sampled = step % 2 == 0
        assert _CAPTURE.listening == listening + (2 if sampled else 0)  # both layers listen while sampled
        assert (float8_linear.hp_tensor_to_float8_dynamic is not torchao_function) == (sampled or listening > 0)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        per_step.append(len(casts))
        monitor.step(step)
    monitor.flush()
    assert per_step[0] == per_step[1] == per_step[2] > 0  # a sampled step casts exactly what an unsampled one does
    assert all(sink.value(m, "0", 0) is not None for m in ("weight_rel_l2", "act_rel_l2", "grad_rel_l2"))
    monitor.close()
    assert _CAPTURE.listening == listening
    assert monitor.stats()["failures"] == {}


def test_float8_training_finds_every_layer_with_formats_and_measures_every_metric() -> None:
    model = float8_model("tensorwise")
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="f8-train", exporter=sink, every=1)
    assert [(str(i), i.adapter) for i in monitor.layers] == [("0", "torchao.float8"), ("2", "torchao.float8")]
    assert (
        monitor.layer_formats()
        == [{"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}] * 2
    )
    train(model, monitor, lambda: torch.randn(8, 32))
    for _batch, record in sink.records():
        assert set(record.metrics) == DEFAULT
        assert all(v is not None for values in record.metrics.values() for v in values), record.step
    assert monitor.stats()["failures"] == {}
    monitor.close()


def test_float8_rowwise_formats() -> None:
    monitor = qw.attach(float8_model("rowwise"), run="f8-row", exporter=qw.InMemoryExporter())
    assert monitor.layer_formats()[0] == {"weight": "fp8_e4m3:row", "input": "fp8_e4m3:row", "grad": "fp8_e4m3:row"}
    monitor.close()


def test_float8_tensor_kept_in_high_precision_reports_no_figure() -> None:
    def off() -> CastConfig:
        return CastConfig(scaling_type=ScalingType.DISABLED)

    config = Float8LinearConfig(
        cast_config_input=off(),
        cast_config_weight=off(),  # forward GEMM in high precision
        cast_config_weight_for_grad_input=CastConfig(),
        cast_config_input_for_grad_weight=off(),
        cast_config_grad_output_for_grad_weight=off(),  # weight-gradient GEMM too: only the input gradient's is FP8
    )
    model = float8_model(config)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="f8-hp", exporter=sink, every=1)
    # weight and grad are reported from the casts of the input-gradient GEMM, the only ones there are
    formats = {"weight": "fp8_e4m3:tensor", "input": "high_precision", "grad": "fp8_e5m2:tensor"}
    assert monitor.layer_formats()[0] == formats
    capture = one_step(model, monitor, torch.randn(8, 32))
    layer, c = model[0], capture["0"]
    wq = torchao_cast(layer, c["w"].t(), layer.config.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1)
    assert sink.value("weight_rel_l2", "0", 0) == pytest.approx(rel_l2(wq.to_original_precision(), c["w"].t()))
    assert all("act_rel_l2" not in record.metrics for _, record in sink.records())  # no layer has an input figure
    assert sink.value("grad_rel_l2", "0", 0) is not None
    assert sink.value("output_rel_l2", "0", 0) == pytest.approx(rel_l2(c["y"], F.linear(c["x"], c["w"], c["b"])))
    assert monitor.stats()["failures"] == {}


def test_float8_layer_with_an_unsupported_config_is_reported_once_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn == "0")
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda m, f: f == "1")
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        sink = qw.InMemoryExporter()
        monitor = qw.attach(model, run="f8-fsdp", exporter=sink, every=1)
        train(model, monitor, lambda: torch.randn(8, 32), steps=2)
    messages = [r.getMessage() for r in caplog.records if "cannot be measured" in r.getMessage()]
    assert len(messages) == 1
    assert messages[0].startswith("quantwatch agent: 0 (Float8Linear)")
    assert monitor.layers == ("1",)
    assert monitor.stats()["failures"] == {}
    with pytest.raises(qw.ConfigError):
        qw.attach(model, run="f8-fsdp", exporter=qw.InMemoryExporter(), layers="blocks.*")


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


QAT_CONFIGS = {
    "int8_token-int4_group32": (
        IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
        IntxFakeQuantizeConfig(torch.int4, group_size=32),
        ("int8:token", "int4:group32"),
    ),
    "fp8_row-fp8_tensor": (
        Float8FakeQuantizeConfig(granularity=PerRow()),
        Float8FakeQuantizeConfig(granularity=PerTensor()),
        ("fp8_e4m3:row", "fp8_e4m3:tensor"),
    ),
}


def qat_model(activation: Any, weight: Any) -> Tokens:
    torch.manual_seed(0)
    model = Tokens()
    is_linear = lambda mod, fqn: isinstance(mod, nn.Linear)  # noqa: E731
    quantize_(model, QATConfig(activation_config=activation, weight_config=weight, step="prepare"), filter_fn=is_linear)
    embedding_weight = IntxFakeQuantizeConfig(torch.int4, group_size=32)
    is_embedding = lambda mod, fqn: isinstance(mod, nn.Embedding)  # noqa: E731
    quantize_(model, QATConfig(weight_config=embedding_weight, step="prepare"), filter_fn=is_embedding)
    return model


@pytest.mark.parametrize("configs", list(QAT_CONFIGS))
def test_qat_figures_are_the_fake_quantizers_errors(configs: str) -> None:
    activation, weight, (input_format, weight_format) = QAT_CONFIGS[configs]
    model = qat_model(activation, weight)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="qat", exporter=sink, every=1)
    assert [(str(i), i.adapter) for i in monitor.layers] == [(n, "torchao.qat") for n in ("emb", "fc1", "fc2")]
    assert monitor.layer_formats() == [
        {"weight": "int4:group32", "input": "high_precision", "grad": "high_precision"},
        *[{"weight": weight_format, "input": input_format, "grad": "high_precision"}] * 2,
    ]
    # The collector accepts them: each is sent as layer_formats (a name it does not know is left out, with a warning).
    assert [check_layer_format(f) for f in (input_format, weight_format)] == [input_format, weight_format]
    capture = one_step(model, monitor, torch.randint(0, 50, (4, 8)))
    for name in ("emb", "fc1", "fc2"):
        layer, c = getattr(model, name), capture[name]
        assert sink.value("weight_rel_l2", name, 0) == pytest.approx(
            rel_l2(layer.weight_fake_quantizer(c["w"]), c["w"]), rel=1e-6
        )
        if name == "emb":
            reference = F.embedding(c["x"], c["w"])
            assert sink.value("act_rel_l2", name, 0) is None
        else:
            fq = layer.activation_fake_quantizer
            assert sink.value("act_rel_l2", name, 0) == pytest.approx(rel_l2(fq(c["x"]), c["x"]), rel=1e-6)
            reference = F.linear(c["x"], c["w"], c["b"])
            dy = c["dy"].reshape(-1, 16 if name == "fc2" else 64)
            reference_dw = dy.T @ c["x"].reshape(-1, 64)
            assert sink.value("update_cosine", name, 0) == pytest.approx(cosine(c["dw"], reference_dw), rel=1e-6)
        assert sink.value("output_rel_l2", name, 0) == pytest.approx(rel_l2(c["y"], reference), rel=1e-6)
    assert all("grad_rel_l2" not in record.metrics for _, record in sink.records())  # QAT keeps gradients in HP
    assert monitor.stats()["failures"] == {}


def test_qat_training_measures_every_metric_of_its_quantized_kinds() -> None:
    activation, weight, _ = QAT_CONFIGS["int8_token-int4_group32"]
    model = qat_model(activation, weight)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="qat-train", exporter=sink, every=1)
    train(model, monitor, lambda: torch.randint(0, 50, (4, 8)))
    no_input = {"act_rel_l2", "underflow_ratio", "overflow_ratio", "amax"}
    for _batch, record in sink.records():
        assert set(record.metrics) == DEFAULT - {"grad_rel_l2", "scale"}
        for metric, (emb, fc1, fc2) in record.metrics.items():
            assert fc1 is not None, metric
            assert fc2 is not None, metric
            assert (emb is None) == (metric in no_input), metric
    assert monitor.stats()["failures"] == {}
    monitor.close()


def mxfp8_model(bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=bias), nn.ReLU(), nn.Linear(64, 32, bias=bias))
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL))
    return model


def mx_dequantized(t: Tensor) -> Tensor:
    t2 = t.reshape(-1, t.shape[-1]).contiguous()
    return MXTensor.to_mx(t2, torch.float8_e4m3fn, 32, MXFP8TrainingOpConfig().scale_calculation_mode).dequantize(
        t2.dtype
    )


def test_mxfp8_training_is_recognised_by_its_weight_and_measured() -> None:
    model = mxfp8_model(bias=False)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="mx", exporter=sink, every=1)
    assert [(str(i), i.adapter) for i in monitor.layers] == [(n, "torchao.mxfp8_training") for n in ("0", "2")]
    assert monitor.layer_formats() == [{"weight": "mxfp8", "input": "mxfp8", "grad": "mxfp8"}] * 2
    capture = one_step(model, monitor, torch.randn(32, 64))
    for name in ("0", "2"):
        c = capture[name]
        assert sink.value("weight_rel_l2", name, 0) == pytest.approx(rel_l2(mx_dequantized(c["w"]), c["w"]), rel=1e-6)
        assert sink.value("act_rel_l2", name, 0) == pytest.approx(rel_l2(mx_dequantized(c["x"]), c["x"]), rel=1e-6)
        assert sink.value("grad_rel_l2", name, 0) == pytest.approx(rel_l2(mx_dequantized(c["dy"]), c["dy"]), rel=1e-6)
        reference = F.linear(c["x"], c["w"])
        assert sink.value("output_rel_l2", name, 0) == pytest.approx(rel_l2(c["y"], reference), rel=1e-6)
        assert sink.value("update_cosine", name, 0) == pytest.approx(cosine(c["dw"], c["dy"].T @ c["x"]), rel=1e-6)
    assert monitor.stats()["failures"] == {}


def test_mxfp8_training_output_shows_that_torchao_0_18_drops_the_bias() -> None:
    # torchao 0.18's MXFP8TrainingWeightWrapperTensor runs F.linear(x, W, b) as x @ Wᵀ: the bias is lost, and the
    # comparison with the reference F.linear(x, W, b) says so.
    model = mxfp8_model(bias=True)
    with torch.no_grad():
        model[0].bias.fill_(1.0)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="mx-bias", exporter=sink, every=1, metrics=["output_rel_l2", "weight_rel_l2"])
    one_step(model, monitor, torch.randn(32, 64))
    assert sink.value("weight_rel_l2", "0", 0) < 0.05
    assert sink.value("output_rel_l2", "0", 0) > 0.5


@pytest.mark.parametrize(("kind", "trained"), [("mxfp8", False), ("float8_weight", False), ("mxfp8", True)])
def test_the_shadow_model_runs_training_weight_wrapper_layers_in_high_precision(kind: str, trained: bool) -> None:
    # Without its own dequantize the shadow copy trained quantized in lockstep: weight_drift_rel_l2 was exactly 0.
    # Attached after a training step, an MXFP8 wrapper holds its data as a graph output, which deepcopy refused.
    model = mxfp8_model(bias=False)
    if kind == "float8_weight":
        model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
        quantize_(model, Float8TrainingOpConfig(float8_linear_recipe="tensorwise"))
        for parameter in model.parameters():  # emulated GEMMs on a CPU, as precision.py switches them
            parameter.config = _float8_op_config("fp8", torch.device("cpu"))
    if trained:
        model(torch.randn(32, 64)).pow(2).mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        model.zero_grad()
    sink = qw.InMemoryExporter()
    monitor = attach_with_shadow(model, f"shadow-{kind}", sink, lr=0.1)
    shadow = monitor.shadow_model
    assert shadow is not None
    x = torch.randn(32, 64)
    weights = [high_precision_data(shadow[i].weight) for i in (0, 2)]
    assert torch.equal(shadow(x), F.linear(torch.relu(F.linear(x, weights[0])), weights[1]))
    train_beside_shadow(model, monitor, x, lr=0.1)
    monitor.close()
    drift = rel_l2(high_precision_data(model[0].weight), high_precision_data(shadow[0].weight))
    assert drift > 0
    assert sink.value("weight_drift_rel_l2", "0", 1) == pytest.approx(drift, rel=1e-5)
    assert monitor.stats()["failures"] == {}


def test_layers_that_need_a_gpu_are_recognised_with_their_formats() -> None:
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
    from torchao.prototype.qat import NVFP4FakeQuantizeConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    config = NVFP4FakeQuantizeConfig()
    qat = QATConfig(activation_config=config, weight_config=config, step="prepare")
    quantize_(model, qat, filter_fn=lambda m, f: f == "0")
    quantize_(model, NVFP4TrainingConfig(), filter_fn=lambda m, f: f == "1")
    monitor = qw.attach(model, run="gpu-only", exporter=qw.InMemoryExporter())
    adapters = [(str(i), i.adapter) for i in monitor.layers]
    assert adapters == [("0", "torchao.qat.prototype"), ("1", "torchao.nvfp4_training")]
    assert monitor.layer_formats() == [
        {"weight": "nvfp4", "input": "nvfp4", "grad": "high_precision"},
        {"weight": "nvfp4", "input": "nvfp4", "grad": "nvfp4"},
    ]
    monitor.close()


def test_a_bfloat16_reference_is_computed_in_bfloat16() -> None:
    model = float8_model("tensorwise")
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="f8-bf16", exporter=sink, every=1, reference_dtype="bfloat16")
    capture = one_step(model, monitor, torch.randn(8, 32))
    c = capture["0"]
    reference = F.linear(c["x"].bfloat16(), c["w"].bfloat16(), c["b"].bfloat16())
    assert sink.value("output_rel_l2", "0", 0) == pytest.approx(rel_l2(c["y"], reference.float()), rel=1e-5)
    assert monitor.stats()["failures"] == {}


def test_prototype_mx_qat_figures_are_its_own_casts() -> None:
    from torchao.prototype.qat import MXFakeQuantizeConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    config = MXFakeQuantizeConfig(dtype=torch.float8_e4m3fn)  # kernel_preference=EMULATED by default: runs on a CPU
    quantize_(model, QATConfig(activation_config=config, weight_config=config, step="prepare"))
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="mx-qat", exporter=sink, every=1)
    assert monitor.layer_formats()[0] == {"weight": "mxfp8", "input": "mxfp8", "grad": "high_precision"}
    capture = one_step(model, monitor, torch.randn(32, 64))
    for name in ("0", "2"):
        c = capture[name]
        cast = MXTensor.to_mx(c["w"], torch.float8_e4m3fn, 32, config.scaling_mode).dequantize(torch.float32)
        assert sink.value("weight_rel_l2", name, 0) == pytest.approx(rel_l2(cast, c["w"]), rel=1e-6)
        cast = MXTensor.to_mx(c["x"], torch.float8_e4m3fn, 32, config.scaling_mode).dequantize(torch.float32)
        assert sink.value("act_rel_l2", name, 0) == pytest.approx(rel_l2(cast, c["x"]), rel=1e-6)
        reference = F.linear(c["x"], c["w"], c["b"])
        assert sink.value("output_rel_l2", name, 0) == pytest.approx(rel_l2(c["y"], reference), rel=1e-6)
    assert monitor.stats()["failures"] == {}


@pytest.mark.parametrize("kind", ["float8", "qat"])
def test_the_shadow_model_runs_torchao_layers_in_high_precision(kind: str) -> None:
    activation, weight, _ = QAT_CONFIGS["int8_token-int4_group32"]
    model: nn.Module = float8_model("tensorwise") if kind == "float8" else qat_model(activation, weight)
    make_input = (lambda: torch.randn(8, 32)) if kind == "float8" else (lambda: torch.randint(0, 50, (4, 8)))
    sink = qw.InMemoryExporter()
    monitor = attach_with_shadow(model, f"shadow-{kind}", sink)
    shadow = monitor.shadow_model
    assert shadow is not None
    x = make_input()
    if kind == "float8":
        expected = F.linear(torch.relu(F.linear(x, shadow[0].weight, shadow[0].bias)), shadow[2].weight, shadow[2].bias)
    else:
        hidden = torch.relu(F.linear(F.embedding(x, shadow.emb.weight), shadow.fc1.weight, shadow.fc1.bias))
        expected = F.linear(hidden, shadow.fc2.weight, shadow.fc2.bias)
    assert torch.equal(shadow(x), expected)
    loss = model(x).pow(2).mean()
    loss.backward()
    monitor.step(0, loss=loss, shadow_closure=lambda m: m(x).pow(2).mean())
    monitor.flush()
    assert sink.scalar("loss_shadow", 0) == pytest.approx(float(expected.pow(2).mean()), rel=1e-6)
    assert monitor.stats()["failures"] == {}
