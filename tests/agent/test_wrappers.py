"""The agent under the wrappers training frameworks put around a model: names as in the bare model, and no Dynamo
recompilation or graph break caused by the agent under ``torch.compile`` (DDP and FSDP2: test_distributed.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
from quantwatch.agent.wrappers import CompiledRegions, named_modules, unwrap
from quantwatch.kernels import QuantConfig, Recipe, error_stats, quantize_model


def _fp8(t: Tensor) -> Tensor:
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(t.dtype)


class Fp8Linear(nn.Linear):
    """The reference-forward protocol with torch's float8 cast: compiles into one graph without the agent."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.observer: Any = None

    def forward(self, x: Tensor) -> Tensor:
        wq, xq = _fp8(self.weight.detach()), _fp8(x.detach())
        if self.observer is not None:
            self.observer("weight", error_stats(self.weight.detach(), wq, fmt="fp8_e4m3"))
        return F.linear(x + (xq - x).detach(), self.weight + (wq - self.weight).detach(), self.bias)

    def reference_forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Fp8Linear(16, 32), nn.GELU(), nn.Sequential(Fp8Linear(32, 8)))


def test_wrapper_segments_are_left_out_of_the_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    bare_model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    model = quantize_model(bare_model, Recipe([("*", QuantConfig())]))
    bare = [name for name, _ in model.named_modules()]
    model[1] = checkpoint_wrapper(model[1])
    wrapped = nn.DataParallel(torch.compile(model))  # DataParallel without GPUs calls the module as it is
    assert [name for name, _ in named_modules(wrapped)] == bare
    assert unwrap(wrapped) is model
    monitor = qw.attach(wrapped, run="names", exporter=qw.InMemoryExporter())
    assert monitor.layers == ("0", "1.0")
    monitor.close(10)


class _RecompileCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Recompiling function" in record.getMessage():
            self.count += 1


def _compile_counts(train: Callable[[], None]) -> dict[str, int]:
    """Dynamo's recompiles, compiled frames, graphs and graph breaks while ``train`` runs (from a clean cache)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    handler = _RecompileCounter()
    torch._logging.set_logs(recompiles=True)
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.endswith("__recompiles")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        train()
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        torch._logging.set_logs()
    return {
        "recompiles": handler.count,
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _train_compiled(in_place: bool, monitor_every: int | None, sink: qw.InMemoryExporter) -> Callable[[], None]:
    def train() -> None:
        model = _model()
        if in_place:
            model[2].compile()
            compiled: nn.Module = model
        else:
            compiled = torch.compile(model)
        monitor = None
        if monitor_every is not None:
            monitor = qw.attach(compiled, run="compiled", exporter=sink, every=monitor_every)
            assert monitor.layers == ("0", "2.0")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for step in range(100):
            loss = compiled(torch.randn(8, 16, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if monitor is not None:
                monitor.step(step, loss=loss)
        if monitor is not None:
            assert monitor.close(10)
            assert monitor.stats()["failures"] == {}

    return train


def test_the_agent_causes_no_recompilation_and_reports_every_sampled_step() -> None:
    for in_place in (False, True):
        sink = qw.InMemoryExporter()
        without = _compile_counts(_train_compiled(in_place, None, sink))
        with_agent = _compile_counts(_train_compiled(in_place, 10, sink))
        assert with_agent == without, in_place
        assert without["recompiles"] == 0
        assert without["graph_breaks"] == 0
        records = [r for _, r in sink.records() if r.metrics]
        assert [r.step for r in records] == list(range(0, 100, 10))
        for record in records:
            for metric in ("output_rel_l2", "output_cosine", "output_sqnr_db", "update_cosine", "weight_rel_l2"):
                assert all(v is not None for v in record.metrics[metric]), (in_place, record.step, metric)


def test_compiled_regions_switch_to_eager_and_back() -> None:
    model = _model()
    model[2].compile()
    compiled = torch.compile(model)
    regions = CompiledRegions(compiled)
    assert regions
    forward, call = compiled.forward, model[2]._compiled_call_impl
    regions.run_eager()
    regions.run_eager()  # idempotent
    assert regions.eager
    assert compiled.forward == model.__call__
    assert model[2]._compiled_call_impl is None
    regions.run_compiled()
    assert not regions.eager
    assert compiled.forward is forward
    assert model[2]._compiled_call_impl is call
    assert not CompiledRegions(_model())
