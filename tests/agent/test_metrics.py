"""Every metric recomputed independently for a small model.

The layer under test implements the reference-forward protocol with torch's own float8 dtype as the quantizer
(``torch.float8_e4m3fn``, saturating at ±448), so the expected values come from plain torch arithmetic here, not
from the agent or the kernels package."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.kernels import QuantConfig, QuantLinear, QuantSpec, Recipe, error_stats, quantize, quantize_model

FP8_MAX = 448.0


def fp8(t: Tensor) -> Tensor:
    return t.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(t.dtype)


class _GradQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, layer: ProtocolLinear) -> Tensor:
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        gq = fp8(g)
        if ctx.layer.observer is not None:
            ctx.layer.observer("grad", error_stats(g, gq, fmt="fp8_e4m3"))
        return gq, None


class _Quantizer:
    last_scale: Tensor | None = None


class ProtocolLinear(nn.Linear):
    """A linear layer quantizing weight, input and output gradient to FP8 E4M3 (straight-through)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observer: Any = None
        self.input_quantizer = _Quantizer()

    def forward(self, x: Tensor) -> Tensor:
        wq = fp8(self.weight.detach())
        xq = fp8(x.detach())
        self.input_quantizer.last_scale = torch.tensor([1.0, 0.5])
        if self.observer is not None:
            self.observer("weight", error_stats(self.weight.detach(), wq, fmt="fp8_e4m3"))
            self.observer("input", error_stats(x.detach(), xq, fmt="fp8_e4m3"))
        w_ste = self.weight + (wq - self.weight).detach()
        x_ste = x + (xq - x).detach()
        return _GradQuant.apply(F.linear(x_ste, w_ste, self.bias), self)  # type: ignore[no-any-return]

    def reference_forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ProtocolLinear(8, 16), nn.Tanh(), ProtocolLinear(16, 4))


def _batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g) * 3
    x[0, 0] = 500.0  # overflows FP8 E4M3 (saturates at 448)
    x[1, :4] = 1e-4  # underflows to zero (smallest subnormal is 2**-9)
    y = torch.randn(32, 4, generator=g) * 100  # large targets: large gradients, some FP8 error on them
    return x, y


def _rel_l2(q: Tensor, x: Tensor) -> float:
    return float(torch.linalg.vector_norm((q - x).double()) / torch.linalg.vector_norm(x.double()))


def _cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _train_one_step(model: nn.Module, monitor: qw.Monitor, capture: dict[str, Any]) -> None:
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, ProtocolLinear):

            def save(m: nn.Module, args: tuple[Tensor, ...], out: Tensor, name: str = name) -> None:
                capture[name] = {
                    "x": args[0].detach().clone(),
                    "y": out.detach().clone(),
                    "w": m.weight.detach().clone(),
                    "b": m.bias.detach().clone(),
                }
                out.register_hook(lambda g: capture[name].__setitem__("dy", g.detach().clone()))

            handles.append(module.register_forward_hook(save))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = _batch()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    monitor.step(0, loss=loss)
    for h in handles:
        h.remove()


def test_every_layer_metric_matches_an_independent_computation() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="metrics", exporter=sink, every=1)
    assert monitor.layers == ("0", "2")
    capture: dict[str, Any] = {}
    _train_one_step(model, monitor, capture)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}

    for name in ("0", "2"):
        c = capture[name]
        x, y, w, dy = c["x"], c["y"], c["w"], c["dy"]
        y_ref = F.linear(x, w, c["b"])
        finite_x = x[torch.isfinite(x)]
        expected = {
            "weight_rel_l2": _rel_l2(fp8(w), w),
            "act_rel_l2": _rel_l2(fp8(x), x),
            "grad_rel_l2": _rel_l2(fp8(dy), dy),
            "output_rel_l2": _rel_l2(y, y_ref),
            "output_cosine": _cosine(y, y_ref),
            "output_sqnr_db": 20 * math.log10(float(y_ref.double().norm() / (y - y_ref).double().norm())),
            # the quantized path's weight gradient is fp8(dy)^T fp8(x); the FP32 one is dy^T x
            "update_cosine": _cosine(fp8(dy).T @ fp8(x), dy.T @ x),
            "underflow_ratio": float(((x != 0) & (fp8(x) == 0)).sum() / (x != 0).sum()),
            "overflow_ratio": float((x.abs() > FP8_MAX).sum() / x.numel()),
            "nonfinite_count": 0.0,
            "amax": float(finite_x.abs().max()),
            "scale": 1.0,
        }
        for metric, value in expected.items():
            got = sink.value(metric, name, 0)
            assert got == pytest.approx(value, rel=2e-5, abs=1e-6), (name, metric)
    assert sink.value("overflow_ratio", "0", 0) > 0
    assert sink.value("underflow_ratio", "0", 0) > 0
    assert sink.value("update_cosine", "2", 0) < 1.0
    with torch.no_grad():
        expected_loss = float(F.mse_loss(_model()(_batch()[0]), _batch()[1]))
    assert sink.scalar("loss", 0) == pytest.approx(expected_loss, rel=1e-5)
    assert sink.scalar("step_seconds", 0) > 0
    assert sink.scalar("device_memory_bytes", 0) > 0
    assert sink.scalar("agent_overhead_ratio", 0) >= 0


def test_update_cosine_matches_hand_computed_gradients_with_micro_batches() -> None:
    # Two micro-batches in one step: the statistics combine as partial sums (the cosine over both gradient pairs).
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="micro", exporter=sink, metrics=["update_cosine"], every=1)
    layer = model[2]
    grads: list[tuple[Tensor, Tensor]] = []
    inputs: list[Tensor] = []
    layer.register_forward_hook(lambda m, a, o: inputs.append(a[0].detach()))

    def on_output(m: nn.Module, a: tuple[Tensor, ...], o: Tensor) -> None:
        o.register_hook(lambda g: grads.append((g.detach(), inputs[-1])))

    layer.register_forward_hook(on_output)
    x, y = _batch()
    for part in (slice(0, 16), slice(16, 32)):
        F.mse_loss(model(x[part]), y[part]).backward()
    monitor.step()
    assert monitor.close(10)
    dots = qn = rn = 0.0
    for dy, xin in grads:
        q = (fp8(dy).T @ fp8(xin)).double()
        r = (dy.T @ xin).double()
        dots += float((q * r).sum())
        qn += float((q * q).sum())
        rn += float((r * r).sum())
    assert sink.value("update_cosine", "2", 0) == pytest.approx(dots / math.sqrt(qn * rn), rel=1e-5)


def _fp8_layer_capturing_output_grads(seed: int) -> tuple[QuantLinear, list[tuple[Tensor, Tensor]]]:
    """An FP8 QuantLinear(8, 4) and the (input, output gradient) pairs of its forwards, as backward reaches them."""
    torch.manual_seed(seed)
    layer = QuantLinear(8, 4, weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
    captured: list[tuple[Tensor, Tensor]] = []

    def on_output(m: nn.Module, a: tuple[Tensor, ...], o: Tensor) -> None:
        o.register_hook(lambda g: captured.append((a[0].detach(), g.detach())))

    layer.register_forward_hook(on_output)
    return layer, captured


def _fp8_update_cosine(captured: list[tuple[Tensor, Tensor]]) -> float:
    """The cosine between the quantized path's weight gradient (E5M2 output gradients, E4M3 inputs, per-tensor) and
    the FP32 one, summed over the captured micro-batches, computed here by hand."""
    dots = qn = rn = 0.0
    for xin, dy in captured:
        q = quantize(dy, "fp8_e5m2", "tensor").reshape(-1, 4).T @ quantize(xin, "fp8_e4m3", "tensor").reshape(-1, 8)
        r = dy.reshape(-1, 4).T @ xin.reshape(-1, 8)
        dots += float((q.double() * r.double()).sum())
        qn += float(q.double().square().sum())
        rn += float(r.double().square().sum())
    return dots / math.sqrt(qn * rn)


def _report_two_micro_batches(layer: QuantLinear, run: str, metric: str) -> qw.InMemoryExporter:
    """One reported step of ``layer`` measuring ``metric`` alone over two micro-batches; the monitor is closed."""
    sink = qw.InMemoryExporter()
    monitor = qw.attach(nn.Sequential(layer), run=run, exporter=sink, metrics=[metric], every=1)
    for _ in range(2):
        layer(torch.randn(3, 5, 8)).square().mean().backward()
    monitor.step()
    assert monitor.close(10)
    return sink


def test_quant_linear_update_cosine_from_its_direct_reference_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    # QuantLinear gives its FP32 reference weight gradient directly: with update_cosine alone no reference forward
    # runs, and over two micro-batches the figure is the hand-computed cosine of both gradient pairs.
    layer, captured = _fp8_layer_capturing_output_grads(seed=3)
    reference_calls: list[Tensor] = []
    real_reference = layer.reference_forward
    monkeypatch.setattr(layer, "reference_forward", lambda x: reference_calls.append(x) or real_reference(x))
    sink = _report_two_micro_batches(layer, "direct", "update_cosine")
    assert reference_calls == []
    assert len(captured) == 2
    assert sink.value("update_cosine", "0", 0) == pytest.approx(_fp8_update_cosine(captured), rel=1e-5)


def test_update_rel_l2_is_the_hand_computed_distance_of_the_gradients() -> None:
    # ‖g_q − g_ref‖ / ‖g_ref‖ over the micro-batches' mergeable sums, with Σ(g_q − g_ref)² taken directly: at FP8-sized
    # errors, Σq² − 2Σqx + Σx² would have cancelled most of its digits.
    layer, captured = _fp8_layer_capturing_output_grads(seed=5)
    sink = _report_two_micro_batches(layer, "rel", "update_rel_l2")
    err2 = ref2 = 0.0
    for xin, dy in captured:
        q = quantize(dy, "fp8_e5m2", "tensor").reshape(-1, 4).T @ quantize(xin, "fp8_e4m3", "tensor").reshape(-1, 8)
        r = dy.reshape(-1, 4).T @ xin.reshape(-1, 8)
        err2 += float((q.double() - r.double()).square().sum())
        ref2 += float(r.double().square().sum())
    expected = math.sqrt(err2 / ref2)
    assert 0 < expected < 0.2
    assert sink.value("update_rel_l2", "0", 0) == pytest.approx(expected, rel=1e-4)


def test_consecutive_sampled_steps_keep_the_hooks_and_forget_unpaired_reference_gradients() -> None:
    # every=1: the hooks stay from one sampled step to the next (one forward hook, one weight hook, however many
    # forwards), and a reference gradient left without its weight gradient (a backward to the input only) is
    # forgotten at monitor.step instead of being paired with the next step's weight gradient.
    layer, captured = _fp8_layer_capturing_output_grads(seed=4)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(
        nn.Sequential(layer), run="keep", exporter=sink, metrics=["update_cosine"], every=1, whatif_every=0
    )
    forward_hooks = len(layer._forward_hooks)
    x = torch.randn(3, 5, 8, requires_grad=True)
    torch.autograd.grad(layer(x).square().mean(), x)  # output gradient, no weight gradient
    monitor.step()
    assert len(layer._forward_hooks) == forward_hooks
    for _ in range(2):
        layer(torch.randn(3, 5, 8)).square().mean().backward()
    assert len(layer.weight._backward_hooks) == 1  # type: ignore[attr-defined]
    monitor.step()
    assert monitor.close(10)
    assert len(layer._forward_hooks) == forward_hooks - 1
    assert not layer.weight._backward_hooks  # type: ignore[attr-defined]
    assert [sorted(r.metrics) for _, r in sink.records()] == [[], ["update_cosine"]]  # nothing measured at step 0
    assert len(captured) == 3
    assert sink.value("update_cosine", "0", 1) == pytest.approx(_fp8_update_cosine(captured[1:]), rel=1e-5)


class _SecondOutputLinear(ProtocolLinear):
    """ProtocolLinear whose output is the second output of a multi-output autograd node (unbind)."""

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return torch.stack([torch.zeros_like(y), y]).unbind(0)[1]


def test_update_cosine_follows_the_output_of_a_multi_output_node() -> None:
    # The output gradient is read from the output's autograd node by the output's index: for the second output of
    # an unbind, update_cosine is the plain layer's figure (index 0 would find no gradient and report nothing).
    figures = []
    for layer_type in (ProtocolLinear, _SecondOutputLinear):
        torch.manual_seed(0)
        model = nn.Sequential(layer_type(8, 16), nn.Tanh(), layer_type(16, 4))
        sink = qw.InMemoryExporter()
        monitor = qw.attach(model, run="nr", exporter=sink, metrics=["update_cosine", "output_rel_l2"], every=1)
        x, y = _batch()
        F.mse_loss(model(x), y).backward()
        monitor.step()
        assert monitor.close(10)
        figures.append([sink.value(m, layer, 0) for m in ("update_cosine", "output_rel_l2") for layer in ("0", "2")])
    assert model[2](torch.ones(1, 16)).grad_fn.name() == "UnbindBackward0"
    assert all(v is not None for v in figures[1])
    assert figures[1] == pytest.approx(figures[0], rel=1e-6)


def test_hooks_follow_the_kinds_each_step_needs() -> None:
    # output_rel_l2 every step, update_cosine every other: the weight hook is there on even steps only, and each
    # step reports what it sampled.
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="kinds", exporter=sink, metrics={"output_rel_l2": 1, "update_cosine": 2})
    x, y = _batch()
    weight_hooks = []
    for step in range(4):
        F.mse_loss(model(x), y).backward()
        weight_hooks.append(len(model[0].weight._backward_hooks or {}))  # type: ignore[attr-defined]
        model.zero_grad()
        monitor.step(step)
    assert monitor.close(10)
    assert weight_hooks == [1, 0, 1, 0]
    assert [sorted(r.metrics) for _, r in sink.records()] == [["output_rel_l2", "update_cosine"], ["output_rel_l2"]] * 2
    assert all(v is not None for _, r in sink.records() for values in r.metrics.values() for v in values)


def test_non_finite_input_is_counted_not_raised() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="nan", exporter=sink, every=1)
    x, y = _batch()
    x[2, 3] = float("nan")
    x[3, 1] = float("inf")
    loss = F.mse_loss(model(x), y)
    loss.backward()
    monitor.step(loss=loss)
    assert monitor.close(10)
    assert sink.value("nonfinite_count", "0", 0) >= 2
    assert math.isnan(sink.value("output_rel_l2", "0", 0))  # a poisoned output is reported as NaN, not as a figure
    assert math.isnan(sink.scalar("loss", 0))


def test_qat_module_measured_against_itself_with_fake_quant_off() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16))
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    torch.ao.quantization.prepare_qat(model, inplace=True)
    qat = model[0]
    seen: dict[str, Tensor] = {}

    def first_call(key: str) -> Any:
        # The first call is the quantized forward (the agent's reference forward calls it again, switched off).
        def hook(m: nn.Module, a: tuple[Tensor, ...], o: Tensor) -> None:
            seen.setdefault(key, a[0].detach())
            seen.setdefault(key + "q", o.detach())

        return hook

    qat.weight_fake_quant.register_forward_hook(first_call("w"))
    qat.activation_post_process.register_forward_hook(first_call("a"))
    qat.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), y=o.detach()))
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="qat", exporter=sink, every=1)
    assert monitor.layers == ("0",)
    x = _batch()[0].clamp(-10, 10)
    loss = model(x).square().mean()
    loss.backward()
    monitor.step()
    assert monitor.close(10)
    y_ref = F.linear(seen["x"], seen["w"], qat.bias.detach())
    assert sink.value("weight_rel_l2", "0", 0) == pytest.approx(_rel_l2(seen["wq"], seen["w"]), rel=1e-5)
    assert sink.value("act_rel_l2", "0", 0) == pytest.approx(_rel_l2(seen["aq"], seen["a"]), rel=1e-5)
    assert sink.value("output_rel_l2", "0", 0) == pytest.approx(_rel_l2(seen["y"], y_ref), rel=1e-5)
    assert sink.value("scale", "0", 0) == pytest.approx(float(qat.activation_post_process.scale.max()), rel=1e-6)
    ((_, record),) = sink.records()
    assert "grad_rel_l2" not in record.metrics  # QAT does not quantize gradients: nothing measured, nothing sent
    assert sink.value("output_rel_l2", "0", 0) > 0
    assert bool(qat.weight_fake_quant.fake_quant_enabled[0] == 1)  # restored after the reference forward


def test_quant_linear_from_quantize_model_matches_an_independent_computation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    fp8_cfg = QuantConfig(weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
    fp4_cfg = QuantConfig(weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4"), grad=QuantSpec("fp8_e5m2"))
    quantize_model(model, Recipe(rules=[("0", fp8_cfg), ("2", fp4_cfg)]))
    assert isinstance(model[0], QuantLinear)
    specs = {"0": fp8_cfg, "2": fp4_cfg}

    def q(t: Tensor, spec: QuantSpec | None) -> Tensor:
        assert spec is not None
        return quantize(t, spec.fmt, scaling=spec.scaling)

    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="quant-linear", exporter=sink, every=1)
    assert monitor.layers == ("0", "2")
    capture: dict[str, Any] = {}
    for name in ("0", "2"):

        def save(m: nn.Module, args: tuple[Tensor, ...], out: Tensor, name: str = name) -> None:
            capture[name] = {"x": args[0].detach().clone(), "y": out.detach().clone(), "w": m.weight.detach().clone()}
            out.register_hook(lambda g: capture[name].__setitem__("dy", g.detach().clone()))

        getattr(model, name).register_forward_hook(save)
    x = torch.randn(64, 16)
    loss = model(x).square().mean()
    loss.backward()
    monitor.step(0, loss=loss)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    for name, cfg in specs.items():
        c = capture[name]
        xin, y, w, dy = c["x"], c["y"], c["w"], c["dy"]
        y_ref = F.linear(xin, w, getattr(model, name).bias.detach())
        expected = {
            "weight_rel_l2": _rel_l2(q(w, cfg.weight), w),
            "act_rel_l2": _rel_l2(q(xin, cfg.input), xin),
            "grad_rel_l2": _rel_l2(q(dy, cfg.grad), dy),
            "output_rel_l2": _rel_l2(y, y_ref),
            "output_cosine": _cosine(y, y_ref),
            "update_cosine": _cosine(q(dy, cfg.grad).T @ q(xin, cfg.input), dy.T @ xin),
            "amax": float(xin.abs().max()),
            "scale": float(getattr(model, name).input_quantizer.last_scale.max()),
        }
        for metric, value in expected.items():
            assert sink.value(metric, name, 0) == pytest.approx(value, rel=1e-4, abs=1e-7), (name, metric)
    # NVFP4 is coarser than FP8: the agent must see it
    assert sink.value("output_rel_l2", "2", 0) > sink.value("output_rel_l2", "0", 0)


def test_deferred_statistics_see_the_weights_before_the_optimizer_step() -> None:
    # QuantLinear's statistics on the CPU are computed together after the model's forward (StatsBatch), so an
    # optimizer step before monitor.step must not change what weight_rel_l2 measured: the weight of the forward.
    torch.manual_seed(3)
    model = nn.Sequential(QuantLinear(16, 8, weight=QuantSpec("nvfp4"), input=QuantSpec("fp8_e4m3"), grad=None))
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="deferred", exporter=sink, every=1)
    weight_before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=10.0)  # a large step: a stale figure would differ clearly
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    monitor.step(0)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    expected = _rel_l2(quantize(weight_before, "nvfp4"), weight_before)
    moved = _rel_l2(quantize(model[0].weight.detach(), "nvfp4"), model[0].weight.detach())
    assert abs(expected - moved) > 1e-4
    assert sink.value("weight_rel_l2", "0", 0) == pytest.approx(expected, rel=1e-6)


def test_a_tensor_changed_before_its_deferred_statistics_is_reported_as_not_measured() -> None:
    # Calling the layer directly skips the model-forward flush; the weight then changes in place before
    # monitor.step: its figure is dropped (null) and counted, never computed from the changed weight.
    torch.manual_seed(4)
    reference = QuantSpec("fp8_e4m3", backend="reference")  # its statistics are deferred (the native ones are not)
    layer = QuantLinear(16, 8, weight=reference, input=reference, grad=None)
    model = nn.Sequential(layer)
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="stale", exporter=sink, every=1)
    layer(torch.randn(4, 16))
    with torch.no_grad():
        layer.weight.mul_(2.0)
    monitor.step(0)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {"statistics_stale": 1}
    ((_, record),) = sink.records()
    assert "weight_rel_l2" not in record.metrics
    assert sink.value("act_rel_l2", "0", 0) is not None


def _two_quant_linears() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(
        QuantLinear(16, 16, weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2")),
        QuantLinear(16, 8, weight=QuantSpec("nvfp4"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2")),
    )


def test_a_non_finite_weight_costs_no_other_statistic() -> None:
    # The masked float64 path (non-finite input) reads a weight that requires grad: it must neither fail nor take the
    # other layers' deferred statistics with it. Divergence is when these figures matter most.
    model = _two_quant_linears()
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="inf-weight", exporter=sink, every=1)
    model(torch.randn(4, 16, requires_grad=True)).square().sum().backward()
    monitor.step(0)
    assert monitor.close(10)
    assert "statistics_failed" not in monitor.stats()["failures"]
    assert sink.value("nonfinite_count", "0", 0) >= 1
    for layer in ("0", "1"):
        for metric in ("weight_rel_l2", "act_rel_l2"):
            assert sink.value(metric, layer, 0) is not None, (metric, layer)


def test_an_inference_mode_forward_on_a_sampled_step_does_not_raise() -> None:
    model = _two_quant_linears()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="inference", exporter=sink, every=1)
    with torch.inference_mode():
        out = model(torch.randn(4, 16))
    assert out.shape == (4, 8)
    monitor.step(0)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    assert sink.value("weight_rel_l2", "1", 0) is not None


def test_activation_checkpointing_keeps_the_recomputed_layers_weight_statistics() -> None:
    # The checkpointed layer's forward reruns inside backward, after the last model-forward flush; the optimizer
    # step's pre-hook flushes its statistics before the weights move (the README's loop order: step, then monitor).
    from torch.utils.checkpoint import checkpoint

    model = _two_quant_linears()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="checkpointed", exporter=sink, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(4, 16, requires_grad=True)
    model[1](checkpoint(model[0], x, use_reentrant=False)).square().sum().backward()
    opt.step()
    monitor.step(0)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    assert sink.value("weight_rel_l2", "0", 0) is not None


def test_an_input_changed_in_place_after_the_layer_keeps_its_activation_statistics() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = _two_quant_linears()[0]

        def forward(self, x: Tensor) -> Tensor:
            x = x.clone()
            x += self.fc(x)  # the layer's input changes in place before the model's forward returns
            return x

    model = Residual()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="residual", exporter=sink, every=1)
    x = torch.randn(4, 16)
    model(x)
    monitor.step(0)
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    assert sink.value("act_rel_l2", "fc", 0) == pytest.approx(_rel_l2(quantize(x, "fp8_e4m3", "tensor"), x), rel=1e-6)
