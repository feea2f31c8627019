"""The adapter registry: what attach() finds, the formats it reports, user adapters, and the layers left out."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.adapters import KIND_WEIGHT, AdapterContext, ShadowedLayer, find_layers
from quantwatch.kernels import QuantLinear, QuantSpec, error_stats


class HalfLinear(nn.Linear):
    """A user's quantized layer that QuantWatch knows nothing about: weights rounded to bfloat16 in forward."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(torch.bfloat16).to(x.dtype), self.bias)


class HalfLinearMeasurer(ShadowedLayer):
    def reference(self, x: Tensor) -> Tensor:
        return F.linear(x, self.module.weight, self.module.bias)

    def arm(self, kinds: frozenset[int]) -> None:
        super().arm(kinds)
        self._handles.append(self.module.register_forward_hook(self._weight_stats))

    def _weight_stats(self, module: nn.Module, args: Any, out: Any) -> None:
        w = module.weight.detach()
        self.record(KIND_WEIGHT, error_stats(w, w.to(torch.bfloat16).to(w.dtype)))


class HalfLinearAdapter(qw.Adapter):
    name = "user.half"

    def recognises(self, module: nn.Module) -> bool:
        return isinstance(module, HalfLinear)

    def formats(self, module: nn.Module) -> dict[str, str]:
        return {"weight": "bf16", "input": "high_precision", "grad": "high_precision"}

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> Any:
        return HalfLinearMeasurer(name, module, context)


class BrokenAdapter(qw.Adapter):
    name = "user.broken"

    def recognises(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Tanh)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> Any:
        raise qw.UnsupportedLayerError("this kind of layer cannot be measured")


@pytest.fixture
def registered() -> Iterator[list[qw.AdapterHandle]]:
    handles: list[qw.AdapterHandle] = []
    yield handles
    for handle in handles:
        handle.remove()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        QuantLinear(8, 16, weight=QuantSpec("fp8_e4m3"), input=QuantSpec("mxfp4"), grad=None),
        nn.Tanh(),
        HalfLinear(16, 4),
    )


def test_layers_name_the_adapter_and_formats_and_still_compare_as_names() -> None:
    monitor = qw.attach(_model(), run="found", exporter=qw.InMemoryExporter(), every=1)
    (layer,) = monitor.layers
    assert monitor.layers == ("0",)
    assert layer.adapter == "quantwatch"
    assert monitor.layer_formats() == [{"weight": "fp8_e4m3:tensor", "input": "mxfp4", "grad": "high_precision"}]
    kernel = monitor.watch_kernel(lambda t: t.round(), name="round")
    kernel(torch.ones(3))
    assert [info.adapter for info in monitor.layers] == ["quantwatch", "kernel"]
    monitor.close()


def test_torch_ao_eager_qat_is_an_adapter_with_formats() -> None:
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    model = nn.Sequential(nn.Linear(8, 8))
    model.qconfig = get_default_qat_qconfig("x86")
    with warnings.catch_warnings():  # torch.ao eager QAT is deprecated in favour of torchao's
        warnings.simplefilter("ignore")
        prepare_qat(model, inplace=True)
    found = find_layers(model, None)
    assert {name: (f.adapter.name, f.formats) for name, f in found.items()} == {
        "0": ("torch.ao.qat", {"weight": "int8:channel", "input": "uint8:tensor", "grad": "high_precision"})
    }


def test_a_registered_adapter_measures_its_layers(registered: list[qw.AdapterHandle]) -> None:
    registered.append(qw.register_adapter(HalfLinearAdapter()))
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="user", exporter=sink, every=1)
    assert [(str(i), i.adapter) for i in monitor.layers] == [("0", "quantwatch"), ("2", "user.half")]
    assert monitor.layer_formats()[1]["weight"] == "bf16"
    x = torch.randn(4, 8)
    out = model(x)
    out.sum().backward()
    monitor.step(0)
    monitor.close()
    w = model[2].weight.detach()
    expected = float((w.to(torch.bfloat16).float() - w).norm() / w.norm())
    assert sink.value("weight_rel_l2", "2", 0) == pytest.approx(expected, rel=1e-6)
    assert sink.value("output_rel_l2", "2", 0) is not None
    assert monitor.stats()["failures"] == {}


def test_registration_takes_adapters_only() -> None:
    with pytest.raises(TypeError, match="Adapter"):
        qw.register_adapter(object())  # type: ignore[arg-type]


def test_an_unmeasurable_layer_is_reported_once_and_left_out(
    registered: list[qw.AdapterHandle], caplog: pytest.LogCaptureFixture
) -> None:
    registered.append(qw.register_adapter(BrokenAdapter()))
    model = _model()
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        monitor = qw.attach(model, run="broken", exporter=qw.InMemoryExporter(), every=1)
        for step in range(2):
            model(torch.randn(4, 8)).sum().backward()
            monitor.step(step)
    warnings = [r.getMessage() for r in caplog.records if "cannot be measured" in r.getMessage()]
    assert len(warnings) == 1
    assert "1 (Tanh)" in warnings[0]
    assert "user.broken" in warnings[0]
    assert monitor.layers == ("0",)
    assert monitor.stats()["failures"] == {}
    monitor.close()


def test_layer_patterns_that_match_nothing_raise_config_error() -> None:
    with pytest.raises(qw.ConfigError, match="no quantized layer matches") as info:
        qw.attach(_model(), run="bad", exporter=qw.InMemoryExporter(), layers="blocks.*")
    assert info.value.field == "layers"
    with pytest.raises(qw.ConfigError) as info:
        qw.attach(_model(), run="bad", exporter=qw.InMemoryExporter(), layers=[""])
    assert info.value.field == "layers"


def test_reference_dtype_is_validated() -> None:
    with pytest.raises(qw.ConfigError) as info:
        qw.attach(_model(), run="bad", exporter=qw.InMemoryExporter(), reference_dtype="float16")  # type: ignore[arg-type]
    assert info.value.field == "reference_dtype"


class RaisingAdapter(qw.Adapter):
    name = "user.raising"

    def recognises(self, module: nn.Module) -> bool:
        raise RuntimeError("bug in a user adapter")

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> Any:
        raise AssertionError("never reached")


def test_an_adapter_that_fails_to_inspect_is_skipped_with_one_warning(
    registered: list[qw.AdapterHandle], caplog: pytest.LogCaptureFixture
) -> None:
    registered.append(qw.register_adapter(RaisingAdapter()))
    with caplog.at_level(logging.WARNING, logger="quantwatch.agent"):
        monitor = qw.attach(_model(), run="raising", exporter=qw.InMemoryExporter())
    assert monitor.layers == ("0",)
    assert sum("user.raising" in r.getMessage() for r in caplog.records) == 1
    monitor.close()
