"""`row_comparison_fields`: a comparison against chosen rows of a matrix, read in place, bit for bit the comparison
against the gathered copy (``comparison_fields(x, q.index_select(0, rows))``); declined where it cannot hold that."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from torch import Tensor

from quantwatch.kernels import StatsBatch, native
from quantwatch.kernels.row_stats import (
    RowsPass,
    compare_linear_rows,
    compare_weight_grad_rows,
    comparison_into,
    row_comparison_fields,
    scratch_matrix,
    stratified_rows,
    weight_grad_rows,
)
from quantwatch.kernels.stats import comparison_fields, host_row


@pytest.fixture(autouse=True)
def _library() -> None:
    if not native.available():
        pytest.skip("native kernels unavailable")


def _same(got: object, expected: tuple[float, ...]) -> bool:
    """Every field equal, bit for bit (NaN where the other is NaN)."""
    assert isinstance(got, tuple)
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, expected, strict=True))


def _values(rows: int, columns: int, seed: int) -> Tensor:
    """Rows of normal values, each row of another magnitude (1e-6 to 1e2), with zeros, signed zeros and 1e-30."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-6, 2, rows).unsqueeze(1)
    specials = torch.tensor([0.0, -0.0, 1e-30]).repeat(columns)[:columns]
    values = torch.randn(rows, columns, generator=g) * magnitudes
    return torch.where(torch.rand(rows, columns, generator=g) < 0.2, specials, values)


@pytest.mark.parametrize(
    ("kept", "q_rows", "row"),
    [(16, 128, 768), (16, 128, 256), (16, 128, 1024), (128, 1024, 256), (32, 256, 1024), (1, 3, 16), (5, 5, 32)],
)
@pytest.mark.parametrize("error", [True, False])
def test_in_place_rows_compare_as_the_gathered_copy_bit_for_bit(kept: int, q_rows: int, row: int, error: bool) -> None:
    q = _values(q_rows, row, seed=kept + row)
    g = torch.Generator().manual_seed(row)
    rows = torch.sort(torch.randperm(q_rows, generator=g)[:kept]).values
    x = q.index_select(0, rows) * (1 + 0.01 * torch.randn(kept, row, generator=g))
    expected = comparison_fields(x, q.index_select(0, rows), error=error)
    assert _same(row_comparison_fields(x, q, rows, error=error), expected)


def test_unsorted_and_repeated_rows_and_several_threads() -> None:
    q = _values(600, 256, seed=3)
    rows = torch.tensor([5, 3, 3, 599, 0] * 60)  # 300 rows of 256: 76,800 elements, a parallel pass
    x = torch.randn(300, 256)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert _same(row_comparison_fields(x, q, rows), comparison_fields(x, q.index_select(0, rows)))
    finally:
        torch.set_num_threads(threads)


def test_values_outside_the_kept_rows_are_never_read() -> None:
    q = torch.randn(8, 32)
    q[1] = math.nan
    q[6] = math.inf
    rows = torch.tensor([0, 2, 7])
    x = torch.randn(3, 32)
    assert _same(row_comparison_fields(x, q, rows), comparison_fields(x, q.index_select(0, rows)))


def test_what_cannot_be_read_in_place_is_declined() -> None:
    q = torch.randn(8, 32)
    x = torch.randn(2, 32)
    rows = torch.tensor([1, 4])
    assert row_comparison_fields(x, q, rows) is not None
    q_nan = q.clone()
    q_nan[4, 3] = math.nan
    declined = {
        "a NaN in a kept row": (x, q_nan, rows),
        "an index past the rows": (x, q, torch.tensor([1, 8])),
        "a negative index": (x, q, torch.tensor([-1, 4])),
        "rows of 12 floats, not whole vectors": (torch.randn(2, 12), torch.randn(8, 12), rows),
        "a matrix not contiguous": (x, torch.randn(32, 8).T, rows),
        "float64": (x.double(), q.double(), rows),
        "int32 indices": (x, q, rows.int()),
        "as many indices as rows of x, not more": (x, q, torch.tensor([1, 4, 5])),
        "rows of different lengths": (torch.randn(2, 16), q, rows),
        "a vector, not a matrix": (x.reshape(-1), q, rows),
    }
    for reason, (a, b, r) in declined.items():
        assert row_comparison_fields(a, b, r) is None, reason


def _weighted(fields: tuple[float, ...], weight: float) -> tuple[float, ...]:
    """What the agent's comparisons made of the fields before the pass weighted them itself (comparison.py)."""
    return (*(v * weight for v in fields[:5]), *fields[5:])


@pytest.mark.parametrize(("kept", "q_rows", "row"), [(16, 128, 768), (16, 128, 1024), (128, 1024, 256), (1, 3, 16)])
@pytest.mark.parametrize("weight", [1.0, 8.0, 1024 / 129])
@pytest.mark.parametrize("threads", [1, 2])
def test_fields_written_into_a_row_are_the_weighted_fields_bit_for_bit(
    kept: int, q_rows: int, row: int, weight: float, threads: int
) -> None:
    q = _values(q_rows, row, seed=row)
    rows = torch.sort(torch.randperm(q_rows, generator=torch.Generator().manual_seed(kept))[:kept]).values
    x = q.index_select(0, rows) * 1.01
    saved = torch.get_num_threads()
    batch = StatsBatch()
    try:
        torch.set_num_threads(threads)
        for error in (True, False):
            expected = _weighted(comparison_fields(x, q.index_select(0, rows), error=error), weight)
            for out in (batch.host_row(), host_row()):
                assert row_comparison_fields(x, q, rows, error=error, weight=weight, out=out) is out
                assert _same(tuple(out.values.tolist()), expected)
                assert _same(tuple(out.stats.as_tensor().tolist()), expected)
    finally:
        torch.set_num_threads(saved)


def test_a_declined_pass_leaves_the_row_untouched() -> None:
    q = torch.randn(8, 32)
    q[4, 3] = math.nan
    out = host_row()
    assert row_comparison_fields(torch.randn(2, 32), q, torch.tensor([1, 4]), weight=4.0, out=out) is None
    assert all(math.isnan(v) for v in out.values.tolist())


def _numpy_rows(uniforms: np.ndarray, n: int, k: int) -> list[int]:
    """The stratified rows as agent/rows.py drew them with NumPy before the native draw."""
    bounds = np.arange(k + 1, dtype=np.int64) * n // k
    sizes = bounds[1:] - bounds[:-1]
    return (bounds[:-1] + np.minimum((uniforms * sizes).astype(np.int64), sizes - 1)).tolist()


@pytest.mark.parametrize(("n", "k"), [(128, 16), (1024, 128), (256, 32), (10, 3), (7, 7), (1000, 1), (129, 17)])
def test_the_native_stratified_draws_keep_numpys_rows(n: int, k: int) -> None:
    uniforms = np.random.default_rng(n * k).random(2 * k + 5)
    # Uniforms at the edges too: 0, the largest below 1 and the one below it (the last row of each stratum).
    uniforms[:3] = [0.0, np.nextafter(1.0, 0.0), np.nextafter(1.0, 0.0) - 2.0**-52]
    n2, k2 = 3 * n + 1, max(1, k // 2)
    for start in (0, 5):
        first, second = stratified_rows(uniforms, start, uniforms.ctypes.data, (n, k, n2, k2))
        assert first is not None
        assert second is not None
        assert first.dtype == second.dtype == torch.int64
        assert first.tolist() == _numpy_rows(uniforms[start : start + k], n, k)
        assert second.tolist() == _numpy_rows(uniforms[start + k : start + k + k2], n2, k2)
        only_second = stratified_rows(uniforms, start, uniforms.ctypes.data, (n, 0, n2, k2))
        assert only_second[0] is None
        assert only_second[1] is not None
        assert only_second[1].tolist() == _numpy_rows(uniforms[start : start + k2], n2, k2)
    assert stratified_rows(uniforms, 0, uniforms.ctypes.data, (n, 0, n2, 0)) == (None, None)


@pytest.mark.parametrize(
    ("tokens", "out_features", "in_features", "kept"),
    [
        (128, 768, 256, 96),
        (128, 256, 1024, 32),
        (7, 20, 48, 5),
        (3, 4, 16, 1),
        # last tiles of every row count the kernel's register tiles leave (1 to 5 of 6 rows; 1 and 2 of 3 on AVX2)
        *((9, 40, 64, kept) for kept in (5, 9, 10, 13, 16)),
    ],
)
def test_the_kept_rows_weight_gradient_is_each_rows_float32_sum_over_the_tokens(
    tokens: int, out_features: int, in_features: int, kept: int
) -> None:
    g = torch.Generator().manual_seed(in_features + kept)
    columns = torch.randperm(out_features, generator=g)[:kept]  # unsorted: any kept rows, in any order
    # Small integers times powers of two: every product and partial sum is exact in float32, so each element has
    # one right value whatever the order of the sums.
    dy = torch.randint(-8, 9, (tokens, out_features), generator=g).float() * 2.0**-3
    x = torch.randint(-8, 9, (tokens, in_features), generator=g).float() * 2.0**-5
    exact = dy.index_select(1, columns).T.double().mm(x.double()).float()
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = weight_grad_rows(dy, x, columns)
            assert got is not None
            assert torch.equal(got, exact)
            # Normal values: within float32 sums' rounding of the float64 product, the same bits on any thread count.
            normal = weight_grad_rows(dy * torch.pi, x * torch.e, columns)
            assert normal is not None
            results.append(normal)
        torch.testing.assert_close(
            results[0].double(), (dy * torch.pi)[:, columns].T.double().mm((x * torch.e).double()), rtol=1e-5, atol=1e-4
        )
        assert torch.equal(results[0], results[1])
    finally:
        torch.set_num_threads(saved)


def test_a_kept_rows_weight_gradient_the_pass_cannot_compute_is_declined() -> None:
    dy, x, columns = torch.randn(8, 32), torch.randn(8, 16), torch.tensor([3, 31])
    assert weight_grad_rows(dy, x, columns) is not None
    declined = {
        "an index past dy's columns": (dy, x, torch.tensor([3, 32])),
        "a negative index": (dy, x, torch.tensor([-1, 3])),
        "rows of x of 12 floats, not whole vectors": (dy, torch.randn(8, 12), columns),
        "fewer tokens in x": (dy, torch.randn(7, 16), columns),
        "dy not contiguous": (torch.randn(32, 8).T, x, columns),
        "float64": (dy.double(), x.double(), columns),
        "int32 indices": (dy, x, columns.int()),
    }
    for reason, (a, b, c) in declined.items():
        assert weight_grad_rows(a, b, c) is None, reason


@pytest.mark.parametrize("shape", [(128, 768), (16, 1024), (1000,), (3, 5), (256, 1024)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_comparison_written_into_a_row_is_the_weighted_fields_bit_for_bit(
    shape: tuple[int, ...], threads: int
) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    q = x + 0.01 * torch.randn(shape, generator=g)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for error in (True, False):
            for weight in (1.0, 8.0):
                out = host_row()
                assert comparison_into(x, q, out, error=error, weight=weight)
                assert _same(tuple(out.values.tolist()), _weighted(comparison_fields(x, q, error=error), weight))
    finally:
        torch.set_num_threads(saved)


def test_a_comparison_the_pass_cannot_write_is_declined_and_the_row_untouched() -> None:
    x, q = torch.randn(4, 32), torch.randn(4, 32)
    q_nan = q.clone()
    q_nan[2, 2] = math.inf
    declined = {
        "an infinity": (x, q_nan),
        "float64": (x.double(), q.double()),
        "not contiguous": (x, torch.randn(32, 4).T),
        "fewer elements": (x, q[:3]),
    }
    for reason, (a, b) in declined.items():
        out = host_row()
        assert not comparison_into(a, b, out), reason
        assert all(math.isnan(v) for v in out.values.tolist()), reason


@pytest.mark.parametrize(
    ("tokens", "in_features", "out_features", "kept", "bias"),
    [
        (128, 256, 768, 16, True),
        (128, 1024, 256, 16, True),
        (40, 32, 48, 9, False),
        (3, 16, 16, 1, True),
        # a tile's sums added in lane groups of 8 (AVX2: 12 of 4 by 3, the last group padded) or 16 (4 by 4), with
        # every row and output count at its edge
        (21, 64, 80, 7, True),
    ],
)
def test_a_linear_calls_kept_rows_compare_as_their_reference_computed_then_compared(
    tokens: int, in_features: int, out_features: int, kept: int, bias: bool
) -> None:
    g = torch.Generator().manual_seed(in_features + kept)
    rows = torch.sort(torch.randperm(tokens, generator=g)[:kept]).values
    # Small integers times powers of two: every product and partial sum is exact in float32, so the reference has
    # one right value whatever the order of its sums, and the figures are those of that reference compared.
    x = torch.randint(-8, 9, (tokens, in_features), generator=g).float() * 2.0**-4
    w = torch.randint(-8, 9, (out_features, in_features), generator=g).float() * 2.0**-6
    b = torch.randint(-8, 9, (out_features,), generator=g).float() * 2.0**-3 if bias else None
    exact = x.double().mm(w.double().T) + (0 if b is None else b.double())
    y = (exact * (1 + 0.01 * torch.randn(tokens, out_features, generator=g, dtype=torch.float64))).float()
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = host_row()
            assert compare_linear_rows(x, w, b, rows, y, out, weight=tokens / kept)
            expected = row_comparison_fields(exact.index_select(0, rows).float(), y, rows, weight=tokens / kept)
            assert _same(tuple(out.values.tolist()), expected)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(saved)
    # Normal values: within float32 dot products' rounding of torch's float64 reference.
    xn, wn = x * torch.pi, w * torch.e
    ref = torch.nn.functional.linear(xn.double(), wn.double(), None if b is None else b.double())
    yn = (ref * 1.01).float()
    out = host_row()
    assert compare_linear_rows(xn, wn, b, rows, yn, out)
    expected_fields = comparison_fields(ref.index_select(0, rows), yn.index_select(0, rows).double())
    np.testing.assert_allclose(out.values.tolist()[:4], expected_fields[:4], rtol=1e-5)
    # Σ(q−x)² sees the float32 reference's rounding (δ ≈ 2⁻²⁴·√in of each value) against differences of 1% of the
    # values: its relative error is about 2·2⁻²⁴·√in / (0.01·√(kept·out)), 6e-6 for 1,024 inputs, and its sign and size
    # follow the build's summation order (1.3e-5 measured with AVX2's 8 lanes, under 1e-5 with AVX-512's 16).
    np.testing.assert_allclose(out.values.tolist()[4], expected_fields[4], rtol=5e-5)


def test_a_linear_calls_kept_rows_the_pass_cannot_compare_are_declined_and_the_row_untouched() -> None:
    x, w, b, rows = torch.randn(8, 32), torch.randn(16, 32), torch.randn(16), torch.tensor([1, 6])
    y = torch.randn(8, 16)
    assert compare_linear_rows(x, w, b, rows, y, host_row())
    y_inf = y.clone()
    y_inf[6, 3] = math.inf
    declined = {
        "an infinity in the kept rows": (x, w, b, rows, y_inf),
        "an index past x's rows": (x, w, b, torch.tensor([1, 8]), y),
        "a negative index": (x, w, b, torch.tensor([-1, 6]), y),
        "inputs of 12 features, not whole vectors": (torch.randn(8, 12), torch.randn(16, 12), b, rows, y),
        "outputs of 12 features": (x, torch.randn(12, 32), torch.randn(12), rows, torch.randn(8, 12)),
        "a bias of another length": (x, w, torch.randn(15), rows, y),
        "an output of other rows": (x, w, b, rows, torch.randn(9, 16)),
        "a weight not contiguous": (x, torch.randn(32, 16).T, b, rows, y),
        "float64": (x.double(), w.double(), b.double(), rows, y.double()),
        "int32 indices": (x, w, b, rows.int(), y),
    }
    for reason, args in declined.items():
        out = host_row()
        assert not compare_linear_rows(*args, out), reason
        assert all(math.isnan(v) for v in out.values.tolist()), reason


@pytest.mark.parametrize(("tokens", "out_features", "in_features", "kept"), [(128, 768, 256, 96), (7, 20, 48, 5)])
def test_a_kept_rows_update_compares_as_its_reference_gradient_computed_then_compared_bit_for_bit(
    tokens: int, out_features: int, in_features: int, kept: int
) -> None:
    g = torch.Generator().manual_seed(out_features + kept)
    columns = torch.sort(torch.randperm(out_features, generator=g)[:kept]).values
    dy, x = torch.randn(tokens, out_features, generator=g), torch.randn(tokens, in_features, generator=g)
    grad = dy.T.mm(x) + 0.01 * torch.randn(out_features, in_features, generator=g)
    reference = weight_grad_rows(dy, x, columns)
    assert reference is not None
    expected = row_comparison_fields(reference, grad, columns, weight=out_features / kept)
    out = host_row()
    assert compare_weight_grad_rows(dy, x, columns, grad, out, weight=out_features / kept) is RowsPass.COMPARED
    assert _same(tuple(out.values.tolist()), expected)  # type: ignore[arg-type]
    declined = {
        "a gradient of other rows": (dy, x, columns, grad[:-1]),
        "a gradient not contiguous": (dy, x, columns, grad.T.contiguous().T),
        "rows of x not whole vectors": (dy, x[:, :12].contiguous(), columns, grad[:, :12].contiguous()),
        "an index past the gradient's rows": (dy, x, torch.tensor([0, out_features]), grad),
    }
    for reason, args in declined.items():
        untouched = host_row()
        assert compare_weight_grad_rows(*args, untouched) is RowsPass.DECLINED, reason
        assert all(math.isnan(v) for v in untouched.values.tolist()), reason


def test_a_kept_rows_update_writes_its_reference_rows_where_asked_also_when_it_declines_on_the_values() -> None:
    g = torch.Generator().manual_seed(3)
    tokens, out_features, in_features = 16, 40, 32
    columns = torch.tensor([1, 7, 22, 39])
    dy, x = torch.randn(tokens, out_features, generator=g), torch.randn(tokens, in_features, generator=g)
    grad = dy.T.mm(x) + 0.01 * torch.randn(out_features, in_features, generator=g)
    expected = weight_grad_rows(dy, x, columns)
    assert expected is not None
    reference, out = torch.full((4, in_features), math.nan), host_row()
    assert compare_weight_grad_rows(dy, x, columns, grad, out, reference=reference) is RowsPass.COMPARED
    assert torch.equal(reference, expected)
    infinite = grad.clone()
    infinite[22, 5] = math.inf  # a kept row: the comparison declines on it, the reference is computed all the same
    reference, untouched = torch.full((4, in_features), math.nan), host_row()
    ended = compare_weight_grad_rows(dy, x, columns, infinite, untouched, reference=reference)
    assert ended is RowsPass.REFERENCE
    assert torch.equal(reference, expected)
    assert all(math.isnan(v) for v in untouched.values.tolist())
    for reason, buffer in {
        "a buffer of other rows": torch.full((3, in_features), math.nan),
        "float64": torch.full((4, in_features), math.nan, dtype=torch.float64),
        "not contiguous": torch.full((in_features, 4), math.nan).T,
    }.items():
        assert compare_weight_grad_rows(dy, x, columns, grad, host_row(), reference=buffer) is RowsPass.DECLINED, reason
        assert bool(buffer.isnan().all()), reason
    declined = torch.full((4, in_features), math.nan)
    out_of_range = torch.tensor([1, 7, 22, 40])
    assert compare_weight_grad_rows(dy, x, out_of_range, grad, host_row(), reference=declined) is RowsPass.DECLINED
    assert bool(declined.isnan().all())


def _twelve_bit(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """Values of 12-bit significands below 1: a product of two is exact in float32, and a float32 sum plus such a
    product is exact in float64, so `_fused` rounds once, as a fused multiply-add does; float32 sums of them round."""
    return torch.randint(-4095, 4096, shape, generator=g).float() * 2.0**-12


def _fused(total: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``total + a · b`` rounded once to float32 (exact in float64 for `_twelve_bit` values)."""
    return (a.astype(np.float64) * b + total).astype(np.float32)


def _lane_tree(lanes: np.ndarray) -> np.ndarray:
    """The float32 sum of the last axis' lanes as the kernels add them: lane i with lane i + L/2, those with their
    i + L/4, ... down to neighbours."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def _build_lanes() -> int:
    """The vector width of the loaded build's kernels (floats); skips on a build whose sums are not fused."""
    lanes = {"avx2": 8, "avx512": 16}.get(native.vector_isa())
    if lanes is None:
        pytest.skip("a generic build: whether its sums are fused is the compiler's choice")
    return lanes


@pytest.mark.parametrize(("tokens", "in_features", "out_features", "kept"), [(21, 64, 80, 7), (128, 1024, 256, 16)])
def test_a_linear_calls_kept_rows_reference_sums_each_dot_product_in_the_documented_order(
    tokens: int, in_features: int, out_features: int, kept: int
) -> None:
    # The order qw_compare_linear_rows documents, whatever its register tiles: lane j of each element sums
    # x[i]·w[i] for i = j, j + L, j + 2L, ... one fused multiply-add each, the lanes are added as a tree, then the
    # bias. Its float32 roundings make another order differ in the last bits, which the figures then show.
    lanes = _build_lanes()
    g = torch.Generator().manual_seed(tokens)
    rows = torch.sort(torch.randperm(tokens, generator=g)[:kept]).values
    x, w = _twelve_bit((tokens, in_features), g), _twelve_bit((out_features, in_features), g)
    b = _twelve_bit((out_features,), g)
    kept_x, weights = x.index_select(0, rows).numpy(), w.numpy()
    sums = np.zeros((kept, out_features, lanes), dtype=np.float32)
    for v in range(0, in_features, lanes):
        sums = _fused(sums, kept_x[:, None, v : v + lanes], weights[None, :, v : v + lanes])
    reference = torch.from_numpy(_lane_tree(sums) + b.numpy())
    y = (x.double().mm(w.double().T) * (1 + 0.01 * torch.randn(tokens, out_features, generator=g).double())).float()
    out = host_row()
    assert compare_linear_rows(x, w, b, rows, y, out, weight=tokens / kept)
    expected = row_comparison_fields(reference, y, rows, weight=tokens / kept)
    assert _same(tuple(out.values.tolist()), expected)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tokens", "out_features", "in_features", "kept"), [(9, 40, 64, 5), (128, 768, 256, 96)])
def test_the_kept_rows_weight_gradient_sums_each_element_over_the_tokens_in_order(
    tokens: int, out_features: int, in_features: int, kept: int
) -> None:
    # Each element a float32 sum over the tokens in their order, one fused multiply-add each, whatever the tiles.
    _build_lanes()
    g = torch.Generator().manual_seed(tokens)
    columns = torch.randperm(out_features, generator=g)[:kept]
    dy, x = _twelve_bit((tokens, out_features), g), _twelve_bit((tokens, in_features), g)
    kept_dy, inputs = dy.index_select(1, columns).numpy(), x.numpy()
    expected = np.zeros((kept, in_features), dtype=np.float32)
    for t in range(tokens):
        expected = _fused(expected, kept_dy[t][:, None], inputs[t][None, :])
    got = weight_grad_rows(dy, x, columns)
    assert got is not None
    assert torch.equal(got, torch.from_numpy(expected))


def test_the_scratch_matrix_is_one_memory_per_thread_grown_when_too_small() -> None:
    small = scratch_matrix(4, 8)
    assert small.shape == (4, 8)
    assert small.dtype == torch.float32
    assert scratch_matrix(2, 16).data_ptr() == small.data_ptr()  # another shape, the same memory
    large = scratch_matrix(64, 64)
    assert large.shape == (64, 64)
    assert scratch_matrix(4, 8).data_ptr() == large.data_ptr()
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(scratch_matrix(4, 8).data_ptr()))
    thread.start()
    thread.join()
    assert other[0] != large.data_ptr()
