"""transformers' GPT-2 converts whole: its ``Conv1D`` layers become `QuantConv1D` (tiny random init, no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quantwatch.agent as qw
from quantwatch.kernels import QuantConfig, QuantConv1D, QuantLinear, Recipe, quantize_model
from quantwatch.kernels.conv1d import is_conv1d

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

STEPS = 4


def _tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def test_conv1d_is_recognised_by_class_path() -> None:
    assert is_conv1d(Conv1D(4, 3))
    assert not is_conv1d(nn.Linear(3, 4))


def test_unquantized_conversion_gives_the_original_outputs_exactly() -> None:
    model = _tiny_gpt2()
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    conv_weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, Conv1D)}
    quantize_model(model, Recipe(default=QuantConfig(weight=None, input=None, grad=None)))
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    for name, weight in conv_weights.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, QuantConv1D)
        assert layer.weight is weight  # the same Parameter, still (in, out)
        assert layer.linear_weight().shape == (layer.out_features, layer.in_features)


def test_quantized_gpt2_trains_under_attach_with_every_metric() -> None:
    model = _tiny_gpt2().train()
    conv_names = [name for name, m in model.named_modules() if isinstance(m, Conv1D)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before the conversion: must keep working
    quantize_model(model, Recipe(default=QuantConfig()))
    assert conv_names
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    assert all(isinstance(model.get_submodule(name), QuantConv1D) for name in conv_names)
    first = model.get_submodule(conv_names[0]).weight.detach().clone()
    sink = qw.InMemoryExporter()
    with qw.attach(model, run="gpt2", exporter=sink, every=1) as monitor:
        for step in range(STEPS):
            ids = _ids()
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(step, loss=loss)
    assert not torch.equal(first, model.get_submodule(conv_names[0]).weight)
    records = [record for batch in sink.batches for record in batch.steps]
    assert [r.step for r in records] == list(range(STEPS))
    layers = sink.batches[0].layers
    assert set(conv_names) <= set(layers)
    for record in records:
        assert set(qw.DEFAULT_METRICS) <= set(record.metrics)
        for metric in ("weight_rel_l2", "act_rel_l2", "grad_rel_l2", "output_rel_l2", "update_cosine"):
            assert all(v is not None for v in record.metrics[metric]), (metric, record.step)


def test_update_cosine_of_quant_conv1d_is_one_without_quantization() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(6, 5))
    quantize_model(model, Recipe(default=QuantConfig(weight=None, input=None, grad=None)))
    sink = qw.InMemoryExporter()
    with qw.attach(model, run="conv1d", exporter=sink, every=1, metrics=["update_cosine"]) as monitor:
        model(torch.randn(4, 5)).square().sum().backward()
        monitor.step(0)
    (value,) = sink.batches[0].steps[0].metrics["update_cosine"]
    assert value == pytest.approx(1.0, abs=1e-6)


def test_an_uninitialised_lazy_linear_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"'1'.*LazyLinear"):
        quantize_model(model, Recipe(default=QuantConfig()))
    model(torch.randn(2, 4))  # initialised now: it converts like any Linear
    quantize_model(model, Recipe(default=QuantConfig()))
    assert isinstance(model[1], QuantLinear)
    assert model[1].in_features == 4
