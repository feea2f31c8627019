"""``monitor.on_alert`` and ``qw.actions``: alerts from the real ingest answer, delivered once on the training thread at
a step boundary, never mid-step; each action switches the real layers (QuantLinear, torchao Float8Linear and QAT) and
is recorded on the run."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

import quantwatch.agent as qw
from quantwatch.agent.precision import switch_precision
from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model

FP4 = QuantSpec("fp4_e2m1", scaling="tensor")
FIRING = {"episode": 5, "rule": "r", "layer": "1", "ranks": [0], "since_step": 1, "severity": "warning"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return quantize_model(
        nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), Recipe(default=QuantConfig(weight=FP4, input=FP4, grad=FP4))
    )


def _train(
    model: nn.Module,
    monitor: qw.Monitor,
    steps: range,
    during: Callable[[int], None] | None = None,
    *,
    width: int = 8,
    scalars: Callable[[int, torch.Tensor], dict[str, float]] | None = None,
) -> None:
    """SGD steps on random inputs of ``width``; ``during(step)`` after the optimizer step, before ``monitor.step``,
    which gets ``scalars(step, loss)`` (default: the loss)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        loss = model(torch.randn(4, width)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if during is not None:
            during(step)
        monitor.step(step, **(scalars(step, loss) if scalars is not None else {"loss": loss.detach()}))


def test_an_alert_learnt_mid_step_is_acted_on_only_at_the_next_step_boundary() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="between", exporter=sink, every=1)
    calls: list[tuple[int, str]] = []
    monitor.on_alert(lambda a: (calls.append((a.episode, threading.current_thread().name)),
                                qw.actions.keep_high_precision([a.layer], format="fp8")))  # fmt: skip
    grads_quantized_with: list[str] = []
    model[1].register_full_backward_hook(lambda *_: grads_quantized_with.append(model[1].grad_quantizer.spec.fmt))

    def mid_step(step: int) -> None:
        if step == 2:  # the exporter thread's answer lands after this step's backward, before its monitor.step
            receiver = threading.Thread(target=monitor._loop.inbox.receive, args=([FIRING],))
            receiver.start()
            receiver.join()
            assert calls == []
            assert model[1].weight_quantizer.spec == FP4

    _train(model, monitor, range(6), mid_step)
    monitor.close()
    # Delivered once, on the training thread, at step 2's boundary; the episode stays listed in later answers.
    assert calls == [(5, threading.main_thread().name)]
    assert grads_quantized_with == ["fp4_e2m1"] * 3 + ["fp8_e5m2"] * 3
    assert [(a.step, a.action, a.layer, a.episode) for b in sink.batches for a in b.actions] == [
        (2, "keep_high_precision", "1", 5)
    ]
    formats = {r.step: b.layer_formats[1] for b in sink.batches for r in b.steps if r.metrics and b.layer_formats}
    assert formats[2]["weight"] == "fp4_e2m1:tensor"  # step 2 ran in FP4 ...
    assert formats[3] == {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
    assert [layer.formats["weight"] for layer in monitor.layers] == ["fp4_e2m1:tensor", "fp8_e4m3:tensor"]


def test_a_failing_callback_is_logged_and_counted_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    monitor = qw.attach(model, run="raises", exporter=qw.InMemoryExporter(), every=1)
    monitor.on_alert(lambda alert: 1 / 0)
    second = [FIRING, {**FIRING, "episode": 6}]
    _train(model, monitor, range(4), lambda s: monitor._loop.inbox.receive([FIRING] if s < 2 else second))
    monitor.close()
    assert monitor.stats()["failures"] == {"alert_callback": 2}  # one per new episode, each once
    assert "on_alert callback failed" in caplog.text
    with pytest.raises(qw.ConfigError, match="callback"):
        monitor.on_alert("not callable")  # type: ignore[arg-type]


def test_the_ingest_answer_brings_the_collectors_alert_to_the_callback(live_collector: Any) -> None:
    model = _model()
    monitor = qw.attach(model, run="live-loop", url=live_collector.url, every=1, flush_interval_seconds=0.1)
    alerts: list[qw.Alert] = []
    monitor.on_alert(alerts.append)
    # A loss 2x the FP32 one from step 2 on: the shipped loss rule fires on what the agent sends, 3 steps later.
    _train(
        model,
        monitor,
        range(8),
        lambda step: monitor.flush(10),  # the previous step's answer is in before this step's boundary
        scalars=lambda step, loss: {"loss": 2.0 if step >= 2 else 1.0, "loss_shadow": 1.0},
    )
    monitor.close()
    episodes = httpx.get(f"{live_collector.url}/api/v1/alerts", params={"run": "live-loop"}).json()
    firing = [(e["id"], e["rule"]) for e in episodes if e["state"] == "firing"]
    assert firing
    assert [(a.episode, a.rule) for a in alerts] == firing
    assert all(a.ranks == (0,) and a.since_step is not None for a in alerts)


def test_stop_training_and_checkpoints_say_which_weights(tmp_path: Path) -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="stop", exporter=sink, every=1)
    qw.actions.save_shadow_checkpoint(tmp_path / "master.pt")
    qw.actions.stop_training()  # the newest open monitor's
    assert not monitor.should_stop  # requests wait for the step boundary
    _train(model, monitor, range(1))
    assert monitor.should_stop
    monitor.close()
    saved = torch.load(tmp_path / "master.pt")
    assert torch.equal(saved["1.weight"], model[1].weight)
    details = {a.action: a.detail for b in sink.batches for a in b.actions}
    assert details["save_shadow_checkpoint"].startswith("the model's master weights (float32; no shadow model)")
    assert details["stop_training"] == "training asked to stop after this step"

    shadowed = _model()
    monitor = qw.attach(shadowed, run="shadow", exporter=sink, every=1, shadow="model",
                        shadow_optimizer=lambda p: torch.optim.SGD(p, lr=0.05))  # fmt: skip
    qw.actions.save_shadow_checkpoint(tmp_path / "shadow.pt", monitor=monitor)
    monitor.step(0, shadow_closure=lambda m: m(torch.ones(2, 8)).sum())
    monitor.close()
    assert monitor.shadow_model is not None
    assert torch.equal(torch.load(tmp_path / "shadow.pt")["1.weight"], monitor.shadow_model[1].weight)
    assert any("FP32 shadow model's weights" in a.detail for b in sink.batches for a in b.actions)


def test_bad_requests_raise_config_errors_naming_the_field() -> None:
    monitor = qw.attach(_model(), run="bad", exporter=qw.InMemoryExporter(), every=1)
    with pytest.raises(qw.ConfigError, match="format"):
        qw.actions.keep_high_precision("1", format="fp9")
    with pytest.raises(qw.ConfigError, match="layers"):
        qw.actions.keep_high_precision([])
    with pytest.raises(qw.ConfigError, match="path"):
        qw.actions.save_shadow_checkpoint("")
    monitor.close()


def _switched(model: nn.Module, layer: str) -> tuple[dict[str, str], str]:
    """Train a step, keep ``layer`` in high precision, train another: its formats after, and the action's detail."""
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="torchao", exporter=sink, every=1)
    _train(model, monitor, range(2), lambda step: step == 0 and qw.actions.keep_high_precision(layer), width=16)
    monitor.close()
    [action] = [a for b in sink.batches for a in b.actions]
    return dict(next(i for i in monitor.layers if i == layer).formats), action.detail


def test_torchao_float8_and_qat_layers_are_kept_in_high_precision() -> None:
    with warnings.catch_warnings():  # torchao's CUDA-only extensions warn on a CPU
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    torch.manual_seed(0)
    float8 = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    convert_to_float8_training(float8, config=Float8LinearConfig(emulate=True))
    formats, detail = _switched(float8, "1")
    assert formats == {"weight": "high_precision", "input": "high_precision", "grad": "high_precision"}
    assert detail.startswith("weight fp8_e4m3:tensor → high_precision; input fp8_e4m3:tensor → high_precision")
    # Its GEMMs are plain ones now: the output is the high-precision linear's.
    x = torch.randn(3, 32)
    assert torch.equal(float8[1](x), nn.functional.linear(x, float8[1].weight, float8[1].bias))
    with pytest.raises(qw.ConfigError, match="format"):
        switch_precision(float8[0], "nvfp4")  # a Float8Linear takes float8 recipes only (tests/agent/test_precision.py)

    qat = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    weight = IntxFakeQuantizeConfig(torch.int4, group_size=16)
    quantize_(qat, QATConfig(activation_config=None, weight_config=weight, step="prepare"))
    formats, detail = _switched(qat, "0")
    assert formats["weight"] == "high_precision"
    assert detail == "weight int4:group16 → high_precision"
    assert not qat[0].weight_fake_quantizer.enabled
    assert qat[1].weight_fake_quantizer.enabled  # only the layer asked for
    assert dataclasses.is_dataclass(float8[1].config)
