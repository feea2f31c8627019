"""``shadow_rows``: output_* and update_cosine estimated from a seeded subset of rows, against the exact figures on
the benchmark model (bench/agent_overhead.py), and marked as estimated."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import quantwatch.agent as qw
from quantwatch.agent.rows import RowSampler, RowSampling, parse_shadow_rows
from quantwatch.kernels.row_stats import RowsPass

# Stated bounds at 1/8 of the rows (16 of the 128 tokens of a call; 1/8 of a weight gradient's rows), max over every
# layer and step of the run below; measured maxima over 10 steps (BENCHMARKS.md, session 15): 0.063, 0.122 and 0.29
# (the torchao Float8Linear variant of the model: 0.055, 0.110 and 0.22).
OUTPUT_REL_L2_BOUND = 0.08  # |estimate − exact| / exact of output_rel_l2
OUTPUT_DEVIATION_BOUND = 0.15  # the same of 1 − output_cosine
UPDATE_DEVIATION_BOUND = 0.5  # the same of 1 − update_cosine
STEPS = 4


def _bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "bench" / "agent_overhead.py"
    spec = importlib.util.spec_from_file_location("qw_bench_agent_overhead", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(bench: Any, model: nn.Module, shadow_rows: float | None) -> list[qw.StepRecord]:
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="rows", exporter=sink, every=1, shadow_rows=shadow_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        tokens = torch.randint(0, bench.VOCAB, (4, 33), generator=gen)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, bench.VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        monitor.step()
    assert monitor.close(10)
    assert monitor.stats()["failures"] == {}
    return [record for _, record in sink.records()]


def _relative_errors(exact: list[qw.StepRecord], estimate: list[qw.StepRecord], metric: str) -> np.ndarray:
    x = np.array([r.metrics[metric] for r in exact], dtype=float)
    y = np.array([r.metrics[metric] for r in estimate], dtype=float)
    if "cosine" in metric:
        x, y = 1 - x, 1 - y
    return np.abs(y - x) / np.abs(x)


def test_an_eighth_of_the_rows_estimates_the_bench_models_figures_within_the_stated_bounds() -> None:
    bench = _bench()
    torch.set_num_threads(2)
    base = bench.make_model()
    exact = _run(bench, copy.deepcopy(base), None)
    estimate = _run(bench, copy.deepcopy(base), 1 / 8)
    estimated = {"output_rel_l2", "output_cosine", "output_sqnr_db", "update_cosine", "update_rel_l2"}
    assert all(r.estimated == estimated for r in estimate)
    assert all(r.estimated == frozenset() for r in exact)
    assert _relative_errors(exact, estimate, "output_rel_l2").max() <= OUTPUT_REL_L2_BOUND
    assert _relative_errors(exact, estimate, "output_cosine").max() <= OUTPUT_DEVIATION_BOUND
    assert _relative_errors(exact, estimate, "update_cosine").max() <= UPDATE_DEVIATION_BOUND
    # The rest is measured as without shadow_rows (the two runs train identically: the agent changes nothing).
    for a, b in zip(exact, estimate, strict=True):
        for metric in ("weight_rel_l2", "act_rel_l2", "grad_rel_l2"):
            assert a.metrics[metric] == b.metrics[metric]


def test_all_rows_or_a_count_above_the_rows_is_exact_and_unmarked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(qw_linear())
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="rows", exporter=sink, every=1, shadow_rows=64)  # 8 rows per call: all kept
    model(torch.randn(8, 16)).square().sum().backward()
    monitor.step()
    assert monitor.close(10)
    ((_, record),) = sink.records()
    # 64 of 8 tokens keeps every token, and 64/8 of the gradient's rows is every row: exact.
    assert record.estimated == frozenset()
    assert parse_shadow_rows(1.0) is None
    assert parse_shadow_rows(None) is None


def qw_linear() -> nn.Module:
    from quantwatch.kernels import QuantLinear

    return QuantLinear(16, 32)


def test_the_draw_is_stratified_seeded_and_without_repeats() -> None:
    sampler = RowSampler(RowSampling(fraction=1 / 8), seed=7)
    rows = sampler.draw(128, torch.device("cpu"))
    assert rows is not None
    assert rows.tolist() == sorted(set(rows.tolist()))
    assert [r // 8 for r in rows.tolist()] == list(range(16))  # one row in each stratum of 8
    again = RowSampler(RowSampling(fraction=1 / 8), seed=7).draw(128, torch.device("cpu"))
    assert again is not None
    assert torch.equal(rows, again)
    assert RowSampler(RowSampling(count=5), seed=0).draw(5, torch.device("cpu")) is None
    uneven = RowSampler(RowSampling(count=3), seed=0).draw(10, torch.device("cpu"))
    assert uneven is not None
    assert [0 <= r < 10 for r in uneven.tolist()] == [True] * 3


def test_kept_rows_read_in_place_give_the_gathered_rows_figures_bit_for_bit(monkeypatch: Any) -> None:
    """Where the reference of the kept rows is computed first (a layer the one-pass comparisons decline), they are
    compared where they lie in each output and weight gradient (one native pass); gathering them first, as before,
    gives the same figures to the last bit, every layer and step."""
    import quantwatch.agent.comparison as comparison
    import quantwatch.agent.layers as layers

    bench = _bench()
    torch.set_num_threads(1)
    base = bench.make_model()
    monkeypatch.setattr(layers, "compare_linear_rows", lambda *args, **kwargs: False)
    monkeypatch.setattr(layers, "compare_weight_grad_rows", lambda *args, **kwargs: RowsPass.DECLINED)
    read = comparison.row_comparison_fields
    calls = {"in place": 0}

    def counted(*args: Any, **kwargs: Any) -> Any:
        fields = read(*args, **kwargs)
        calls["in place"] += fields is not None
        return fields

    monkeypatch.setattr(comparison, "row_comparison_fields", counted)
    in_place = _run(bench, copy.deepcopy(base), 1 / 8)
    assert calls["in place"] == 2 * 16 * STEPS  # every layer's output and update comparison, every step
    monkeypatch.setattr(comparison, "row_comparison_fields", lambda *args, **kwargs: None)
    _same_figures(in_place, _run(bench, copy.deepcopy(base), 1 / 8))


def test_one_pass_kept_rows_comparisons_give_the_figures_of_references_computed_then_compared(
    monkeypatch: Any,
) -> None:
    """Each kept-rows comparison of the bench model is one native pass computing the reference rows as it compares
    them.  Against the references computed first (torch's matmul of the gathered rows for the output, the same
    native pass for the weight gradient) and compared after: the update figures the same to the last bit, the
    output figures within the float32 rounding of the reference's sums, taken in another order."""
    import quantwatch.agent.layers as layers

    bench = _bench()
    torch.set_num_threads(1)
    base = bench.make_model()
    done = {"output": 0, "update": 0}

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> bool:
            result = bool(function(*args, **kwargs))
            done[name] += result
            return result

        return call

    monkeypatch.setattr(layers, "compare_linear_rows", counted("output", layers.compare_linear_rows))
    monkeypatch.setattr(layers, "compare_weight_grad_rows", counted("update", layers.compare_weight_grad_rows))
    one_pass = _run(bench, copy.deepcopy(base), 1 / 8)
    assert done == {"output": 16 * STEPS, "update": 16 * STEPS}  # every layer, every step
    monkeypatch.setattr(layers, "compare_linear_rows", lambda *args, **kwargs: False)
    monkeypatch.setattr(layers, "compare_weight_grad_rows", lambda *args, **kwargs: RowsPass.DECLINED)
    computed_first = _run(bench, copy.deepcopy(base), 1 / 8)
    for a, b in zip(one_pass, computed_first, strict=True):
        assert a.estimated == b.estimated
        for metric in ("update_cosine", "update_rel_l2", "weight_rel_l2", "act_rel_l2", "grad_rel_l2"):
            assert a.metrics[metric] == b.metrics[metric], metric
        np.testing.assert_allclose(a.metrics["output_rel_l2"], b.metrics["output_rel_l2"], rtol=1e-4)
        np.testing.assert_allclose(a.metrics["output_sqnr_db"], b.metrics["output_sqnr_db"], rtol=1e-4)
        deviation = 1 - np.array(a.metrics["output_cosine"]), 1 - np.array(b.metrics["output_cosine"])
        np.testing.assert_allclose(*deviation, rtol=1e-2)


def test_exact_reference_gradients_made_at_the_weight_hook_give_the_figures_of_ones_made_at_the_output(
    monkeypatch: Any,
) -> None:
    """Exact comparisons: the FP32 reference weight gradient is computed when the quantized path's gradient arrives
    (the same matmul on the same tensors), no longer when the output gradient does; every figure stays the same, to
    the last bit, every layer and step."""
    from quantwatch.agent.layers import _ShadowedModuleAdapter
    from quantwatch.agent.shadow import run_reference

    bench = _bench()
    torch.set_num_threads(1)
    base = bench.make_model()
    at_weight_hook = _run(bench, copy.deepcopy(base), None)

    def at_output(self: Any, direct_grad: Any, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        reference = run_reference(direct_grad, x, grad_output.detach(), dtype=self.options.reference_dtype)
        self._pending_reference_grads.append((reference, None))

    monkeypatch.setattr(_ShadowedModuleAdapter, "_reference_grad_direct", at_output)
    _same_figures(at_weight_hook, _run(bench, copy.deepcopy(base), None))


def _same_figures(a_records: list[qw.StepRecord], b_records: list[qw.StepRecord]) -> None:
    """Every metric of every layer and step equal, bit for bit (NaN where the other is NaN)."""
    for a, b in zip(a_records, b_records, strict=True):
        assert a.estimated == b.estimated
        assert a.metrics.keys() == b.metrics.keys()
        for metric, values in a.metrics.items():
            got, expected = np.array(values, dtype=float), np.array(b.metrics[metric], dtype=float)
            assert np.array_equal(got, expected, equal_nan=True), metric


def test_exact_comparisons_written_into_their_rows_natively_give_the_figures_of_the_python_fields(
    monkeypatch: Any,
) -> None:
    """Exact comparisons: one native pass writes each comparison's fields into its statistics row; computed as the
    host fields in Python and then copied into the row, every figure is the same, to the last bit, every layer and
    step."""
    import quantwatch.agent.comparison as comparison

    native, written = comparison.comparison_into, []

    def writing(*args: Any, **kwargs: Any) -> bool:
        written.append(native(*args, **kwargs))
        return written[-1]

    bench = _bench()
    torch.set_num_threads(1)
    base = bench.make_model()
    monkeypatch.setattr(comparison, "comparison_into", writing)
    natively = _run(bench, copy.deepcopy(base), None)
    assert written == [True] * (2 * 16 * STEPS)  # every layer's output and update comparison, every step
    monkeypatch.setattr(comparison, "comparison_into", lambda *args, **kwargs: False)
    _same_figures(natively, _run(bench, copy.deepcopy(base), None))


def _broken(*args: Any, **kwargs: Any) -> bool:
    raise RuntimeError("broken pass")


def _two_kept_rows_steps(model: nn.Module) -> tuple[qw.Monitor, qw.InMemoryExporter]:
    """Two training steps of ``model`` watched at ``every=1`` with half the rows kept; the closed monitor and its
    sink."""
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="rows", exporter=sink, every=1, shadow_rows=1 / 2)
    for _ in range(2):
        model(torch.randn(8, 16)).square().sum().backward()
        monitor.step()
    assert monitor.close(10)
    return monitor, sink


@pytest.mark.parametrize(
    ("broken", "failure", "missing"),
    [
        ("compare_linear_rows", "reference_forward_failed", ("output_rel_l2", "update_cosine")),
        ("compare_weight_grad_rows", "update_compare_failed", ("update_cosine",)),
    ],
)
def test_a_failing_kept_rows_comparison_is_counted_never_raised_into_training(
    monkeypatch: Any, broken: str, failure: str, missing: tuple[str, ...]
) -> None:
    """A forward hook that fails leaves that call's output and update comparisons out; a weight hook, its update."""
    import quantwatch.agent.layers as layers

    monkeypatch.setattr(layers, broken, _broken)
    torch.manual_seed(0)
    monitor, sink = _two_kept_rows_steps(nn.Sequential(qw_linear()))
    assert monitor.stats()["failures"] == {failure: 2}
    records = [record for _, record in sink.records()]
    assert len(records) == 2
    for record in records:
        assert not set(missing) & record.metrics.keys()
        assert record.metrics["weight_rel_l2"][0] is not None
        assert ("output_rel_l2" in record.metrics) is (broken != "compare_linear_rows")


def test_a_kept_rows_update_declined_on_its_values_compares_the_reference_rows_the_pass_computed(
    monkeypatch: Any,
) -> None:
    """A weight gradient holding infinities in its kept rows: the one-pass comparison declines, and the reference
    rows it computed are compared another way, never computed a second time; the figures those of the reference
    computed again (a signal: not finite)."""
    import quantwatch.agent.layers as layers

    computed = {"again": 0}
    weight_grad_rows = layers.weight_grad_rows

    def counted(*args: Any, **kwargs: Any) -> Any:
        computed["again"] += 1
        return weight_grad_rows(*args, **kwargs)

    def run() -> list[qw.StepRecord]:
        torch.manual_seed(0)
        model = nn.Sequential(qw_linear())
        # Registered before the agent's own hook on the weight, so the agent sees the gradient it returns.
        model[0].weight.register_hook(lambda grad: grad.index_fill(0, torch.arange(32), torch.inf))
        monitor, sink = _two_kept_rows_steps(model)
        assert monitor.stats()["failures"] == {}
        return [record for _, record in sink.records()]

    monkeypatch.setattr(layers, "weight_grad_rows", counted)
    reused = run()
    assert computed["again"] == 0
    monkeypatch.setattr(layers, "compare_weight_grad_rows", lambda *args, **kwargs: RowsPass.DECLINED)
    again = run()
    assert computed["again"] == 2  # each step's update, its reference computed a second time
    assert len(reused) == len(again) == 2
    for a, b in zip(reused, again, strict=True):
        assert not math.isfinite(a.metrics["update_rel_l2"][0])
        assert "update_cosine" in a.estimated
        assert a.estimated == b.estimated
        for metric in ("update_rel_l2", "update_cosine"):
            np.testing.assert_array_equal(np.array(a.metrics[metric], float), np.array(b.metrics[metric], float))


def test_a_transposed_gradient_is_compared_in_one_native_pass_as_its_contiguous_copy() -> None:
    """A weight gradient that torchao computes as ``(Xᵀ dY)ᵀ`` (INT8 mixed-precision training) is a transposed view:
    against a reference of either layout its comparison is the native pass's over contiguous matrices, bit for bit
    (before, it took the NumPy way: other roundings, five passes and a copy)."""
    from quantwatch.agent.comparison import comparison_stats
    from quantwatch.kernels import ErrorStats
    from quantwatch.kernels import native as native_kernels

    native_kernels.prepare()
    gen = torch.Generator().manual_seed(3)
    reference = torch.randn(96, 64, generator=gen)
    value = reference + 0.01 * torch.randn(96, 64, generator=gen)

    def fields(stats: ErrorStats) -> np.ndarray:
        return np.array([float(getattr(stats, name)) for name in ErrorStats.FIELDS])

    def transposed(t: torch.Tensor) -> torch.Tensor:  # the same values, stored column by column
        return t.mT.contiguous().mT

    contiguous = fields(comparison_stats(reference, value))
    assert np.array_equal(fields(comparison_stats(reference, transposed(value))), contiguous, equal_nan=True)
    both = fields(comparison_stats(transposed(reference), transposed(value)))
    assert np.array_equal(
        both, fields(comparison_stats(reference.mT.contiguous(), value.mT.contiguous())), equal_nan=True
    )
