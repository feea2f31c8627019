"""QuantLinear, its observer and reference_forward, Quantizer, QuantSpec and quantize_model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from quantwatch.kernels import (
    ErrorStats,
    QuantConfig,
    QuantLinear,
    QuantSpec,
    Recipe,
    StatsBatch,
    error_stats,
    quantize,
    quantize_model,
)
from quantwatch.kernels import quantizer as quantizer_module
from quantwatch.kernels.stats import FlushResult


def test_reference_forward_equals_nn_linear() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(12, 7)
    layer = QuantLinear.from_linear(plain, weight=QuantSpec("nvfp4"), input=QuantSpec("mxfp4"))
    x = torch.randn(5, 12)
    assert torch.equal(layer.reference_forward(x), plain(x))
    assert layer.weight is plain.weight
    assert layer.bias is plain.bias
    # The quantized forward differs (that is the point) but stays close.
    out = layer(x)
    assert not torch.equal(out, plain(x))
    assert error_stats(plain(x), out).rel_l2.item() < 0.3


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("leading", [(), (5,), (2, 3)], ids=["1d", "2d", "3d"])
def test_reference_weight_grad_equals_autograd_through_reference_forward(leading: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(5)
    layer = QuantLinear(6, 4, bias=bias)
    x = torch.randn(*leading, 6)
    upstream = torch.randn(*leading, 4)
    (expected,) = torch.autograd.grad(layer.reference_forward(x), layer.weight, upstream)
    got = layer.reference_weight_grad(x, upstream)
    assert got.shape == layer.weight.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_forward_is_linear_of_the_quantized_tensors() -> None:
    torch.manual_seed(1)
    layer = QuantLinear(16, 8, weight=QuantSpec("fp8_e4m3"), input=QuantSpec("int8", scaling="channel:0"), grad=None)
    x = torch.randn(4, 16)
    w_q = quantize(layer.weight.detach(), "fp8_e4m3", scaling="tensor")
    x_q = quantize(x, "int8", scaling="channel:0")
    assert torch.equal(layer(x), nn.functional.linear(x_q, w_q, layer.bias))


def test_backward_quantizes_the_output_gradient_and_passes_straight_through() -> None:
    torch.manual_seed(2)
    layer = QuantLinear(16, 8, weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
    x = torch.randn(4, 16, requires_grad=True)
    out = layer(x)
    upstream = torch.randn(4, 8) * 1e-3
    out.backward(upstream)
    g_q = quantize(upstream, "fp8_e5m2", scaling="tensor")
    w_q = quantize(layer.weight.detach(), "fp8_e4m3", scaling="tensor")
    x_q = quantize(x.detach(), "fp8_e4m3", scaling="tensor")
    assert x.grad is not None
    assert layer.weight.grad is not None
    torch.testing.assert_close(x.grad, g_q @ w_q, rtol=1e-6, atol=0)  # STE: identity through Q_in
    torch.testing.assert_close(layer.weight.grad, g_q.T @ x_q, rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.bias.grad, g_q.sum(0), rtol=1e-6, atol=0)


def test_quant_linear_trains() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(
        QuantLinear(8, 32, weight=QuantSpec("nvfp4"), input=QuantSpec("mxfp4")),
        nn.ReLU(),
        QuantLinear(32, 1),
    )
    x = torch.randn(256, 8)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # FP32 master weights


def test_observer_receives_the_stats_of_each_quantization() -> None:
    torch.manual_seed(4)
    layer = QuantLinear(16, 8, weight=QuantSpec("mxfp4"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
    seen: list[tuple[str, ErrorStats]] = []
    layer.observer = lambda role, stats: seen.append((role, stats))
    x = torch.randn(4, 16)
    out = layer(x)
    assert [role for role, _ in seen] == ["weight", "input"]
    captured: list[torch.Tensor] = []
    out.register_hook(lambda g: captured.append(g))
    upstream = torch.randn(4, 8)
    out.backward(upstream)
    assert [role for role, _ in seen] == ["weight", "input", "grad"]
    expected = {
        "weight": quantize(layer.weight.detach(), "mxfp4", with_stats=True)[1],
        "input": quantize(x, "fp8_e4m3", scaling="tensor", with_stats=True)[1],
        "grad": quantize(captured[0], "fp8_e5m2", scaling="tensor", with_stats=True)[1],
    }
    for role, stats in seen:
        assert stats.as_tensor().dtype == torch.float64
        torch.testing.assert_close(stats.as_tensor(), expected[role].as_tensor(), rtol=1e-12, atol=0)


def test_observed_quantizations_collect_into_the_stats_batch() -> None:
    # With a StatsBatch the observer gets the statistics of weight and gradient before they are computed, and the
    # input's at once (a caller may change the input in place right after the forward); after flush they all equal
    # what the layer without a batch reports.
    # The reference backend's statistics are the ones a batch defers (the fast backends compute theirs in the pass).
    torch.manual_seed(6)
    specs = {
        "weight": QuantSpec("nvfp4", backend="reference"),
        "input": QuantSpec("fp8_e4m3", backend="reference"),
        "grad": QuantSpec("fp8_e5m2", backend="reference"),
    }
    plain = QuantLinear(16, 8, **specs)
    batched = QuantLinear(16, 8, **specs)
    batched.load_state_dict(plain.state_dict())
    batch = StatsBatch()
    batched.stats_batch = batch
    seen: dict[str, list[tuple[str, ErrorStats]]] = {"plain": [], "batched": []}
    plain.observer = lambda role, stats: seen["plain"].append((role, stats))
    batched.observer = lambda role, stats: seen["batched"].append((role, stats))
    x = torch.randn(4, 16)
    for layer in (plain, batched):
        layer(x).square().sum().backward()
    assert len(batch) == 2
    pending = {role: bool(torch.isnan(stats.as_tensor()).all()) for role, stats in seen["batched"]}
    assert pending == {"weight": True, "input": False, "grad": True}
    assert batch.flush() == FlushResult()
    for (role, got), (plain_role, expected) in zip(seen["batched"], seen["plain"], strict=True):
        assert role == plain_role
        assert torch.equal(got.as_tensor(), expected.as_tensor())


def test_no_observer_means_no_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    flags: list[bool] = []
    real = quantizer_module.quantize_with_backend

    def spy(*args: Any, **kwargs: Any) -> Any:
        flags.append(args[7])  # with_stats
        return real(*args, **kwargs)

    monkeypatch.setattr(quantizer_module, "quantize_with_backend", spy)
    layer = QuantLinear(8, 4)
    layer(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert flags == [False, False, False]
    layer.observer = lambda role, stats: None
    layer(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert flags[3:] == [True, True, True]


def test_disabled_specs_leave_tensors_alone() -> None:
    layer = QuantLinear(8, 4, weight=None, input=None, grad=None)
    seen: list[str] = []
    layer.observer = lambda role, stats: seen.append(role)
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), layer.reference_forward(x))
    assert seen == []


def test_quantizer_records_last_scale_and_amax() -> None:
    layer = QuantLinear(8, 64)
    assert layer.weight_quantizer.last_scale is None
    layer(torch.randn(2, 8))
    quantizer = layer.weight_quantizer
    assert quantizer.last_amax is not None
    assert quantizer.last_scale is not None
    assert quantizer.last_amax.item() == layer.weight.detach().abs().max().item()
    assert quantizer.last_scale.item() == pytest.approx(quantizer.last_amax.item() / 448.0, rel=1e-7)
    block = QuantLinear(64, 8, weight=QuantSpec("mxfp4"))
    block(torch.randn(2, 64))
    assert block.weight_quantizer.last_scale is not None
    assert block.weight_quantizer.last_scale.shape == (8, 2)


def test_quant_spec_resolves_and_validates() -> None:
    assert QuantSpec("fp8_e4m3").scaling == "tensor"
    assert QuantSpec("mxfp4").scaling == "block:32"
    assert QuantSpec("nvfp4").scaling == "nvblock:16"
    assert QuantSpec("int8", scaling="channel").scaling == "channel:0"
    assert QuantSpec("fp8_e5m2", rounding="STOCHASTIC").rounding == "stochastic"
    with pytest.raises(ValueError, match="unknown format"):
        QuantSpec("fp9")
    with pytest.raises(ValueError, match="fixes scaling"):
        QuantSpec("mxfp4", scaling="tensor")
    with pytest.raises(ValueError, match="backend"):
        QuantSpec("fp8_e4m3", backend="gpu")
    with pytest.raises(TypeError, match="saturate"):
        QuantSpec("fp8_e4m3", saturate="yes")  # type: ignore[arg-type]


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
        nn.Linear(16, 2),
    )


def test_quantize_model_by_glob_rules() -> None:
    model = build_model()
    original = {name: module.weight for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    fp4 = QuantConfig(weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4"))
    recipe = Recipe(rules=[("0", QuantConfig()), ("1.1", None), ("1.*", fp4)], default=None)
    quantize_model(model, recipe)
    layers = dict(model.named_modules())
    assert isinstance(layers["0"], QuantLinear)
    assert layers["0"].weight_quantizer.spec == QuantSpec("fp8_e4m3")
    assert isinstance(layers["1.0"], QuantLinear)
    assert layers["1.0"].weight_quantizer.spec == QuantSpec("nvfp4")
    assert type(layers["1.1"]) is nn.Linear  # first match wins: kept in full precision
    assert type(layers["2"]) is nn.Linear  # no rule, no default
    for name, weight in original.items():
        assert layers[name].weight is weight
    assert model(torch.randn(3, 8)).shape == (3, 2)


def test_quantize_model_keeps_an_existing_optimizer_working() -> None:
    torch.manual_seed(5)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    quantize_model(model, Recipe(default=QuantConfig()))
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model[0].weight.detach())
    # Converting again is a no-op: QuantLinear is not converted twice.
    assert quantize_model(model, Recipe(default=QuantConfig())) is model


def test_quantize_model_bad_input() -> None:
    with pytest.raises(TypeError, match="Recipe"):
        quantize_model(build_model(), {"*": QuantConfig()})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        Recipe(rules=[("*", "fp8")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"QuantConfig\.weight"):
        QuantConfig(weight="fp8_e4m3")  # type: ignore[arg-type]
    single = quantize_model(nn.Linear(4, 4), Recipe(default=QuantConfig()))
    assert isinstance(single, QuantLinear)
