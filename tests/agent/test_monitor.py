"""attach() and Monitor: configuration errors, the sampling gate, kernels, shadow model, never raising."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

import quantwatch.agent as qw
import quantwatch.agent.layers as layers_module
import quantwatch.kernels as kernels_module
from quantwatch.agent.sampling import Schedule


class Protocol(nn.Linear):
    """Minimal reference-forward module: rounds its weight to a grid of 1/4, counts reference calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observer: Any = None
        self.reference_calls = 0
        self.observed_calls = 0

    def forward(self, x: Tensor) -> Tensor:
        wq = torch.round(self.weight * 4) / 4
        if self.observer is not None:
            self.observed_calls += 1
            self.observer("weight", kernels_module.error_stats(self.weight.detach(), wq.detach()))
        return F.linear(x, self.weight + (wq - self.weight).detach(), self.bias)

    def reference_forward(self, x: Tensor) -> Tensor:
        self.reference_calls += 1
        return F.linear(x, self.weight, self.bias)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Protocol(4, 8), nn.ReLU(), Protocol(8, 2))


def _train(model: nn.Module, monitor: qw.Monitor, steps: int, **step_kwargs: Any) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(16, 4)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, loss=loss, **step_kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"metrics": ["output_rel_l2", "bogus"]}, "metrics"),
        ({"every": 0}, "every"),
        ({"every": -3}, "every"),
        ({"metrics": {"output_rel_l2": 0}}, "every"),
        ({"url": "not a url"}, "url"),
        ({"url": "ftp://host/x"}, "url"),
        ({"url": "http://:80"}, "url"),
        ({"url": "http://host:99999"}, "url"),
        ({"layers": ["nothing.*"]}, "layers"),
        ({"run": "spaces are not allowed"}, "run"),
        ({"ranks": "second"}, "ranks"),
        ({"ranks": [-1]}, "ranks"),
        ({"rank": -2}, "rank"),
        ({"shadow": "half"}, "shadow"),
        ({"shadow": "model"}, "shadow_optimizer"),
        ({"metrics": ["weight_drift_rel_l2"]}, "metrics"),
        ({"start": 10, "end": 5}, "end"),
        ({"spool_max_bytes": -1}, "spool_max_bytes"),
        ({"tokens_per_step": 0}, "tokens_per_step"),
        ({"shadow_rows": 0}, "shadow_rows"),
        ({"shadow_rows": 0.0}, "shadow_rows"),
        ({"shadow_rows": 1.5}, "shadow_rows"),
        ({"shadow_rows": True}, "shadow_rows"),
        ({"shadow_rows": "1/8"}, "shadow_rows"),
        ({"reference_dtype": "float16"}, "reference_dtype"),
    ],
)
def test_configuration_mistakes_raise_config_error_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    args = {"run": "cfg", "url": "http://127.0.0.1:9", **kwargs}
    with pytest.raises(qw.ConfigError) as info:
        qw.attach(_model(), **args)
    assert info.value.field == field
    assert field in str(info.value)


def test_config_error_is_a_value_error_and_agent_error() -> None:
    assert issubclass(qw.ConfigError, ValueError)
    assert issubclass(qw.ConfigError, qw.AgentError)
    assert issubclass(qw.TransientExportError, qw.ExportError)
    assert issubclass(qw.PermanentExportError, qw.ExportError)


def test_schedule_gate_returns_the_next_needed_step() -> None:
    schedule = Schedule({"output_rel_l2": 10, "update_cosine": 25}, start=5, end=60)
    assert schedule.next_step(0) == 5
    assert schedule.next_step(6) == 15
    assert schedule.next_step(29) == 30
    assert schedule.next_step(56) is None
    assert schedule.metrics_at(55) == {"update_cosine", "output_rel_l2"}
    assert schedule.metrics_at(30) == {"update_cosine"}
    assert schedule.metrics_at(15) == {"output_rel_l2"}
    assert schedule.metrics_at(16) == frozenset()
    assert schedule.metrics_at(65) == frozenset()


def test_gate_does_no_work_on_unsampled_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"error_stats": 0}
    original = kernels_module.error_stats

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["error_stats"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels_module, "error_stats", counting)
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="gate", exporter=sink, every=4)
    layer = model[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(9):
        hooks_during_forward = len(layer._forward_hooks)
        observer_set = layer.observer is not None
        before = (layer.reference_calls, calls["error_stats"], layer.observed_calls)
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = (layer.reference_calls, calls["error_stats"], layer.observed_calls)
        sampled = step % 4 == 0
        assert (after != before) is sampled, step
        assert observer_set is sampled
        assert (hooks_during_forward > 0) is sampled
        monitor.step(step, loss=loss)
    assert monitor.close(10)
    # Layer figures on sampled steps only; the loss goes out for every step it was given on (issue 22).
    assert [r.step for _, r in sink.records() if r.metrics] == [0, 4, 8]
    assert [r.step for _, r in sink.records()] == list(range(9))
    assert monitor.stats()["sampled_steps"] == 3
    assert monitor.stats()["steps"] == 9


def test_per_metric_periods_and_windows() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(
        model, run="periods", exporter=sink, metrics={"weight_rel_l2": 2, "output_rel_l2": 3}, start=1, end=8
    )
    _train(model, monitor, 10)
    assert monitor.close(10)
    got = {r.step: set(r.metrics) for _, r in sink.records() if r.metrics}
    assert got == {
        1: {"weight_rel_l2", "output_rel_l2"},
        3: {"weight_rel_l2"},
        4: {"output_rel_l2"},
        5: {"weight_rel_l2"},
        7: {"weight_rel_l2", "output_rel_l2"},
    }


def test_steps_count_themselves_and_scalars_are_sent() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="count", exporter=sink, every=2, tokens_per_step=1000)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        monitor.step(loss=1.5, lr=torch.tensor(0.1))
    assert monitor.close(10)
    assert [r.step for _, r in sink.records() if r.metrics] == [0, 2]
    assert [r.step for _, r in sink.records()] == [0, 1, 2, 3]  # the scalars of every step (issue 22)
    assert sink.scalar("loss", 2) == 1.5
    assert sink.scalar("lr", 2) == pytest.approx(0.1)
    assert sink.scalar("tokens_per_second", 2) == pytest.approx(1000 / sink.scalar("step_seconds", 2))
    assert sink.scalar("agent_sent_batches", 2) >= 0
    assert "agent_failures" in next(iter(sink.records()))[1].scalars


def test_layers_patterns_narrow_what_is_hooked() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="pick", exporter=sink, layers=["2"], every=1)
    assert monitor.layers == ("2",)
    _train(model, monitor, 1)
    assert monitor.close(10)
    assert model[0].reference_calls == 0
    assert model[2].reference_calls == 1


def test_watched_kernel_records_its_error_on_sampled_steps_only() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="kernel", exporter=sink, every=2, metrics=["act_rel_l2", "output_cosine"])
    calls = []

    @monitor.kernel("cast.bf16")
    def to_bf16(x: Tensor) -> Tensor:
        calls.append(1)
        return x.to(torch.bfloat16).to(x.dtype)

    assert monitor.layers == ("0", "2", "cast.bf16")
    inputs = []
    for step in range(3):
        x = torch.randn(64) * (step + 1)
        inputs.append(x)
        to_bf16(x)
        model(torch.randn(2, 4)).sum().backward()
        monitor.step(step)
    assert monitor.close(10)
    assert len(calls) == 3
    for step in (0, 2):
        x = inputs[step].double()
        q = x.float().to(torch.bfloat16).double()
        expected = float((q - x).norm() / x.norm())
        assert sink.value("act_rel_l2", "cast.bf16", step) == pytest.approx(expected, rel=1e-6)
        assert sink.value("output_cosine", "cast.bf16", step) == pytest.approx(float(q @ x / (q.norm() * x.norm())))
    assert [r.step for _, r in sink.records()] == [0, 2]
    with pytest.raises(qw.ConfigError):
        monitor.watch_kernel(to_bf16, name="cast.bf16")


def test_nothing_raises_into_training_after_attach(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Protocol):
        def reference_forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("reference is broken")

    class FailingExporter(qw.InMemoryExporter):
        def export(self, batch: qw.Batch) -> None:
            raise OSError("disk full")

    torch.manual_seed(0)
    model = nn.Sequential(Broken(4, 4))
    monitor = qw.attach(model, run="robust", exporter=FailingExporter(), every=1)
    _train(model, monitor, 3)
    monitor.step(loss=object())  # type: ignore[arg-type]
    monitor.step(**{"bad name!": 1.0})  # type: ignore[arg-type]
    assert monitor.close(10)
    failures = monitor.stats()["failures"]
    assert failures["reference_forward_failed"] == 3
    assert failures["export"] >= 1
    assert failures["scalar_value"] == 1
    assert failures["scalar_name"] == 1
    logged = [r for r in caplog.records if "reference_forward_failed" in r.getMessage()]
    assert len(logged) == 1  # logged once per kind, counted every time


def test_close_removes_every_hook_and_is_idempotent() -> None:
    model = _model()
    monitor = qw.attach(model, run="close", exporter=qw.InMemoryExporter(), every=1)
    assert (
        len(model[0]._forward_hooks) == 2
    )  # the comparisons' and (the first sampled step is a what-if step) what-if's
    assert model[0].observer is not None
    with monitor:
        pass
    assert len(model[0]._forward_hooks) == 0
    assert model[0].observer is None
    assert monitor.close()
    monitor.step(loss=1.0)  # after close: ignored


def test_file_url_writes_ingest_json_lines(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "out" / "run.jsonl"
    monitor = qw.attach(model, run="file:run", url=path.as_uri(), every=1, metrics=["output_rel_l2"])
    _train(model, monitor, 3)
    assert monitor.close(10)
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["step"] for d in docs for s in d["steps"]] == [0, 1, 2]
    assert docs[0]["run"] == "file:run"
    assert docs[0]["layers"] == ["0", "2"]
    assert len(docs[0]["steps"][0]["metrics"]["output_rel_l2"]) == 2


def test_ranks_first_makes_other_ranks_silent() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="r", exporter=sink, rank=1, ranks="first", every=1)
    assert monitor.reporting is False
    _train(model, monitor, 2)
    assert monitor.close(1)
    assert sink.batches == []
    assert model[0].reference_calls == 0
    chosen = qw.attach(_model(), run="r", exporter=qw.InMemoryExporter(), rank=3, ranks=[1, 3])
    assert chosen.reporting
    chosen.close()


def test_full_shadow_model_reports_loss_and_drift_and_saves(tmp_path: Path) -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(
        model,
        run="shadow",
        exporter=sink,
        every=1,
        shadow="model",
        shadow_optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        metrics=["weight_drift_rel_l2", "output_rel_l2"],
    )
    shadow = monitor.shadow_model
    assert shadow is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(16, 4, generator=g)
        with torch.no_grad():
            expected_shadow_loss = float(shadow(x).square().mean())
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.step(step, loss=loss, shadow_closure=lambda m, x=x: m(x).square().mean())
        drift_expected = [
            float((model[i].weight - shadow[i].weight).double().norm() / shadow[i].weight.double().norm())
            for i in (0, 2)
        ]
        monitor.flush(10)
        assert sink.scalar("loss_shadow", step) == pytest.approx(expected_shadow_loss, rel=1e-6)
        for i, name in ((0, "0"), (2, "2")):
            assert sink.value("weight_drift_rel_l2", name, step) == pytest.approx(drift_expected[i // 2], rel=1e-6)
    assert sink.value("weight_drift_rel_l2", "0", 2) > 0
    assert model[0].reference_calls == 3  # output_rel_l2 on each of the 3 steps (the shadow is a separate copy)
    path = tmp_path / "shadow.pt"
    monitor.save_shadow(path)
    restored = _model()
    restored.load_state_dict(torch.load(path))
    assert torch.equal(restored[0].weight, shadow[0].weight)
    assert monitor.close(10)
    with pytest.raises(qw.ConfigError):
        qw.attach(_model(), run="x", exporter=qw.InMemoryExporter()).save_shadow(path)


def test_interpreter_exit_flushes_an_unclosed_monitor(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "exit.jsonl"
    script = textwrap.dedent(
        f"""
        import torch, torch.nn.functional as F
        from torch import nn
        import quantwatch.agent as qw

        class Protocol(nn.Linear):
            def reference_forward(self, x):
                return F.linear(x, self.weight, self.bias)

        model = nn.Sequential(Protocol(4, 4))
        monitor = qw.attach(model, run="exit", url={path.as_uri()!r}, every=1, flush_interval_seconds=3600)
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            monitor.step(step)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["step"] for d in docs for s in d["steps"]] == [0, 1, 2]


def test_overhead_clock_counts_a_nested_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # monitor.step is timed as a whole and flushes the deferred statistics, which are timed when flushed from hooks:
    # the nested block must not be added a second time.
    from quantwatch.agent.layers import OverheadClock

    now = [100.0]
    monkeypatch.setattr(layers_module.time, "perf_counter", lambda: now[0])
    clock = OverheadClock()
    with clock.measure():
        now[0] += 2.0
        with clock.measure():
            now[0] += 3.0
        now[0] += 1.0
    assert clock.seconds == 6.0
    with clock.measure():
        now[0] += 0.5
    assert clock.seconds == 6.5


def test_scalars_go_out_for_every_step_whatever_the_layer_sampling() -> None:
    # every=25: the layers are measured at steps 0 and 25, the loss at every step it is given on, in the same batches.
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="scalars", exporter=sink, every=25, max_batch_steps=64)
    for step in range(30):
        model(torch.randn(2, 4)).square().mean().backward()
        monitor.step(step, loss=torch.tensor(float(step)), lr=0.1)
    assert monitor.close(10)
    records = [record for _, record in sink.records()]
    assert [r.step for r in records] == list(range(30))
    assert [r.step for r in records if r.metrics] == [0, 25]
    assert all(r.scalars["loss"] == float(r.step) and r.scalars["lr"] == 0.1 for r in records)
    assert all("step_seconds" in r.scalars for r in records)
    assert len(sink.batches) < 30


def test_scalars_every_sends_every_nth_step_and_is_checked() -> None:
    model = _model()
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="scalars-5", exporter=sink, every=25, scalars_every=5)
    for step in range(12):
        monitor.step(step, loss=1.0)
    assert monitor.close(10)
    assert [r.step for _, r in sink.records()] == [0, 5, 10]
    with pytest.raises(qw.ConfigError, match="scalars_every"):
        qw.attach(model, run="bad", exporter=qw.InMemoryExporter(), scalars_every=0)
