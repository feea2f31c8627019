"""What-if statistics in the agent: the figures equal quantizing the tensors the layers saw by hand, on their own
period, never in the way of training (through the wire to a collector: tests/e2e/test_whatif_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent import whatif as whatif_module
from quantwatch.agent.options import check_attach_options
from quantwatch.kernels import QuantLinear, QuantSpec, quantize
from quantwatch.protocol import WHATIF_CANDIDATES, candidate_spec


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        QuantLinear(24, 48, grad=QuantSpec("fp8_e5m2")),
        nn.GELU(),
        QuantLinear(48, 16, weight=QuantSpec("fp4_e2m1"), input=QuantSpec("nvfp4"), grad=QuantSpec("fp4_e2m1")),
    )


def _by_hand(x: Tensor, candidate: str, generator: torch.Generator | None) -> dict[str, float]:
    """rel_l2, underflow and overflow shares of ``x`` quantized to ``candidate`` by the reference, in float64."""
    fmt, scaling, rounding = candidate_spec(candidate)
    details = quantize(x, fmt, scaling, rounding, generator=generator, backend="reference", return_details=True)
    x64, q64 = x.double(), details.values.double()
    nonzero = x64 != 0
    return {
        "rel_l2": float((q64 - x64).norm() / x64.norm()),
        "underflow_ratio": float(((q64 == 0) & nonzero).sum() / nonzero.sum()),
        "overflow_ratio": float(details.overflow_mask.double().mean()),
    }


def _train(model: nn.Module, monitor: qw.Monitor, steps: int, seen: dict[str, dict[str, Tensor]] | None = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hooks = []
    if seen is not None:
        for name, module in model.named_children():
            if isinstance(module, QuantLinear):

                def keep(module: nn.Module, args: Any, out: Tensor, name: str = name) -> None:
                    seen[name] = {"weight": module.weight.detach().clone(), "input": args[0].detach().clone()}
                    out.register_hook(lambda g: seen[name].__setitem__("grad", g.detach().clone()))

                hooks.append(module.register_forward_hook(keep))
    torch.manual_seed(11)
    for _ in range(steps):
        loss = model(torch.randn(32, 24)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
    for hook in hooks:
        hook.remove()


def test_whatif_figures_equal_quantizing_the_same_tensors_by_hand() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="whatif", exporter=sink, every=1, whatif_every=1)
    seen: dict[str, dict[str, Tensor]] = {}
    _train(model, monitor, 1, seen)
    monitor.close()
    (record,) = [s for b in sink.batches for s in b.steps]
    assert record.whatif is not None
    layers = list(sink.batches[0].layers)
    assert layers == ["0", "2"]
    assert set(record.whatif["grad"]) == {
        "fp8_e4m3:tensor",
        "mxfp8",
        "nvfp4",
        "mxfp4",
        "fp8_e5m2:tensor",
        "fp8_e5m2:block32",
        "fp8_e5m2:block32+sr",
        "fp4_e2m1:tensor",
        "mxfp4+sr",
    }
    assert set(record.whatif["weight"]) == {"fp8_e4m3:tensor", "mxfp8", "nvfp4", "mxfp4", "fp4_e2m1:tensor"}
    # Stochastic rounding draws from the agent's own generator, gradients in the order backward reaches them.
    generator = torch.Generator().manual_seed(whatif_module.SEED)
    expected: dict[tuple[str, str, int], dict[str, float]] = {}
    for index in (1, 0):
        for candidate in record.whatif["grad"]:
            if candidate.endswith("+sr") and record.whatif["grad"][candidate]["rel_l2"][index] is not None:
                expected[("grad", candidate, index)] = _by_hand(seen[layers[index]]["grad"], candidate, generator)
    compared = 0
    for kind, candidates in record.whatif.items():
        for candidate, stats in candidates.items():
            for index, name in enumerate(layers):
                if stats["rel_l2"][index] is None:
                    assert candidate not in WHATIF_CANDIDATES, candidate  # only a layer's own ones differ
                    continue
                want = expected.get((kind, candidate, index)) or _by_hand(seen[name][kind], candidate, None)
                for stat, value in want.items():
                    assert stats[stat][index] == pytest.approx(value, rel=1e-6, abs=1e-9), (kind, candidate, name, stat)
                compared += 1
    assert compared == 2 * (4 + 4 + 4) + 3 + 2 + 1  # defaults per kind and layer, and each layer's own candidates
    assert record.whatif["grad"]["fp4_e2m1:tensor"]["underflow_ratio"][1] > 0  # FP4 per tensor loses gradients
    assert monitor.stats()["failures"] == {}


def _whatif_steps(steps: int, every: int, **options: Any) -> tuple[list[int], nn.Module]:
    """The steps that carried what-if statistics when the model trained ``steps`` steps, and the model."""
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="period", exporter=sink, every=every, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(11)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny steps: a second thread only waits (on a core the other worker holds)
    try:
        for _ in range(steps):
            model(torch.randn(32, 24)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    finally:
        torch.set_num_threads(threads)
    monitor.close()
    assert monitor.stats()["failures"] == {}
    return [s.step for b in sink.batches for s in b.steps if s.whatif], model


def test_whatif_comes_every_250_steps_by_default_whatever_the_sampling() -> None:
    every_25, model = _whatif_steps(251, every=25)
    assert every_25 == [0, 250]  # every 10th sampled step, as whatif_every=10 would
    assert all(not module._forward_hooks for module in model.modules())
    # A period of 10 sampled steps would measure what-if every 70 steps at every=7; it is the first sampled step at
    # least 250 steps after the previous what-if step.
    assert _whatif_steps(260, every=7)[0] == [0, 252]
    assert whatif_module.WHATIF_STEPS == 250


def test_whatif_every_n_counts_sampled_steps_and_0_turns_it_off() -> None:
    assert _whatif_steps(40, every=2, whatif_every=3)[0] == [0, 6, 12, 18, 24, 30, 36]
    assert _whatif_steps(5, every=1, whatif_every=0)[0] == []


@pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
def test_a_bad_whatif_every_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(qw.ConfigError, match="whatif_every"):
        qw.attach(_model(), run="bad", exporter=qw.InMemoryExporter(), whatif_every=value)
    with pytest.raises(qw.ConfigError, match="whatif_every"):
        check_attach_options(whatif_every=value)


def test_a_failing_quantization_never_reaches_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(whatif_module, "quantize", broken)
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="broken", exporter=sink, every=1, whatif_every=1)
    _train(model, monitor, 2)
    monitor.close()
    steps = [s for b in sink.batches for s in b.steps]
    assert [s.step for s in steps] == [0, 1]
    assert all(s.metrics and not s.whatif for s in steps)
    assert monitor.stats()["failures"]["whatif_failed"] >= 1


def test_a_layer_kept_in_a_format_the_kernels_lack_tries_only_the_default_candidates() -> None:
    candidates = whatif_module.layer_candidates({"weight": "bf16", "input": "uint8", "grad": "fp8_e5m2:tensor"})
    assert candidates["weight"] == WHATIF_CANDIDATES
    assert candidates["input"] == WHATIF_CANDIDATES
    assert candidates["grad"] == (*WHATIF_CANDIDATES, "fp8_e5m2:tensor", "fp8_e5m2:block32", "fp8_e5m2:block32+sr")
