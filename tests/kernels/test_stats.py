"""ErrorStats against statistics recomputed independently in numpy float64; combine, round trips, edge cases."""

from __future__ import annotations

import functools
import math
import threading
import warnings

import numpy as np
import pytest
import torch

from quantwatch.kernels import ErrorStats, StatsBatch, error_stats, native, quantize
from quantwatch.kernels.stats import FlushResult, _chunked_stats, comparison_fields, stats_from_masks
from tests.kernels.conftest import ADVERSARIAL_CASES, UNSUMMABLE_PAIRS, adversarial_pairs

# On the CPU, statistics of finite float32 (and narrower) tensors sum in float32 chunks combined in float64
# (ARCHITECTURE.md "Formulas": float32 or wider): sums and the figures derived from them are held to 1e-6 relative of
# numpy's float64, the fused backends' contract against the reference; max_abs_err is q − x rounded once to float32
# (2^-24 relative); counts and amax stay exact. Float64 tensors, and tensors with non-finite values (the masked
# float64 path): 1e-12.
CHUNKED_SUMS = {"sum_x2", "sum_q2", "sum_qx", "sum_err2", "rel_l2", "cosine", "sqnr_db"}
ROUNDED_ONCE = {"max_abs_err", "max_abs"}


def tolerance(name: str, chunked: bool) -> float:
    if not chunked:
        return 1e-12
    return 1e-6 if name in CHUNKED_SUMS else 2**-24 if name in ROUNDED_ONCE else 1e-12


def numpy_stats(x: np.ndarray, q: np.ndarray, fmt_max: float | None) -> dict[str, float]:
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    finite_x = np.isfinite(x64)
    valid = finite_x & np.isfinite(q64)
    xv, qv = np.where(valid, x64, 0.0), np.where(valid, q64, 0.0)
    err = qv - xv
    nonzero = finite_x & (x64 != 0)
    overflow = finite_x & (~np.isfinite(q64) | ((np.abs(x64) > fmt_max) if fmt_max is not None else False))
    sum_x2, sum_q2, sum_err2 = (xv**2).sum(), (qv**2).sum(), (err**2).sum()
    with np.errstate(divide="ignore", invalid="ignore"):  # zero norms: the degenerate cases give inf/NaN here
        return {
            "numel": x.size,
            "sum_x2": sum_x2,
            "sum_q2": sum_q2,
            "sum_qx": (qv * xv).sum(),
            "sum_err2": sum_err2,
            "max_abs_err": np.abs(err).max(),
            "amax": np.abs(np.where(finite_x, x64, 0)).max(),
            "nonzero_count": nonzero.sum(),
            "underflow_count": (nonzero & (q64 == 0)).sum(),
            "overflow_count": overflow.sum(),
            "nonfinite_count": (~finite_x).sum(),
            "rel_l2": np.linalg.norm(err) / np.linalg.norm(xv),
            "cosine": (qv * xv).sum() / (np.linalg.norm(qv) * np.linalg.norm(xv)),
            "sqnr_db": 20 * np.log10(np.linalg.norm(xv) / np.linalg.norm(err)),
            "max_abs": np.abs(err).max(),
            "underflow_ratio": (nonzero & (q64 == 0)).sum() / nonzero.sum(),
            "overflow_ratio": overflow.sum() / finite_x.sum(),
        }


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("fmt", "scale"), [("fp8_e4m3", 1e3), ("fp4_e2m1", 1.0), ("fp8_e5m2", 1e-4)])
@pytest.mark.parametrize("nonfinite", [True, False], ids=["masked", "all-finite"])
def test_error_stats_match_numpy(fmt: str, scale: float, seed: int, nonfinite: bool) -> None:
    # With non-finite inputs the masked computation runs; all-finite CPU tensors take the unmasked dot products.
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 33)) * scale).astype(np.float32)
    x[0, :5] = [0.0, np.nan, np.inf, -np.inf, 1e-30] if nonfinite else [0.0, -0.0, 1e-30, -1e-30, 3e-8]
    xt = torch.from_numpy(x)
    qt = quantize(xt, fmt)
    stats = error_stats(xt, qt, fmt)
    expected = numpy_stats(x, qt.numpy(), {"fp8_e4m3": 448.0, "fp4_e2m1": 6.0, "fp8_e5m2": 57344.0}[fmt])
    got = stats.to_dict()
    for name, value in expected.items():
        assert got[name] == pytest.approx(float(value), rel=tolerance(name, not nonfinite), abs=0), name
    assert all(getattr(stats, f).dtype == torch.float64 and getattr(stats, f).dim() == 0 for f in ErrorStats.FIELDS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_error_stats_without_a_format_match_numpy(dtype: torch.dtype) -> None:
    # No overflow mask and no underflow mask: underflows are found from x and q, in the tensor's own dtype.
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.standard_normal((40, 24)) * np.logspace(-30, 3, 24)).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, 5e-39], dtype=torch.float64).to(dtype)
    q = quantize(x, "fp8_e5m2", "tensor")
    x_before, q_before = x.clone(), q.clone()
    got = error_stats(x, q).to_dict()
    assert torch.equal(x, x_before)
    assert torch.equal(q, q_before)  # float64 q is not converted, so not copied either: it must stay untouched
    expected = numpy_stats(x.double().numpy(), q.double().numpy(), None)
    assert got["underflow_count"] > 0
    for name, value in expected.items():
        assert got[name] == pytest.approx(float(value), rel=tolerance(name, dtype != torch.float64), abs=0), name


@pytest.mark.parametrize(
    ("fmt", "scaling"), [("fp8_e4m3", "tensor"), ("mxfp4", None), ("nvfp4", None), ("int8", "channel")]
)
@pytest.mark.parametrize("nonfinite", [True, False], ids=["masked", "all-finite"])
def test_quantize_stats_match_numpy(fmt: str, scaling: str | None, nonfinite: bool) -> None:
    # quantize(..., with_stats=True) hands the reference's own underflow and non-zero masks and amax to the
    # statistics: the same figures as finding them from x and q.
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((32, 64)) * np.logspace(-12, 2, 64)).astype(np.float32)
    x[1, :3] = [0.0, np.nan, np.inf] if nonfinite else [0.0, -0.0, 1e-40]
    xt = torch.from_numpy(x)
    q, stats = quantize(xt, fmt, scaling, with_stats=True, backend="reference")
    details = quantize(xt, fmt, scaling, return_details=True)
    expected = numpy_stats(x, q.numpy(), None)
    expected["overflow_count"] = int(details.overflow_mask.sum())
    expected["overflow_ratio"] = expected["overflow_count"] / np.isfinite(x).sum()
    got = stats.to_dict()
    assert got["underflow_count"] > 0
    for name, value in expected.items():
        assert got[name] == pytest.approx(float(value), rel=tolerance(name, not nonfinite), abs=0), name
    assert torch.equal(details.nonzero_mask, torch.isfinite(xt) & (xt != 0))
    found = stats_from_masks(xt, q, details.overflow_mask)
    assert torch.equal(stats.as_tensor(), found.as_tensor())


ADVERSARIAL = [*ADVERSARIAL_CASES, "fp16 cast, rel_l2 ~3e-4", "fp8 e5m2, offset"]


@functools.cache
def _adversarial_pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    n = 1 << 22
    pairs = adversarial_pairs(5, n)
    normal = pairs["q == x"][0]
    # Same-sign values of one magnitude: the case where a plain float32 running sum loses the most.
    offset = 1 + 1e-3 * normal[: n + 3 - (1 << 10)]  # a length no power of two ≥ 256 divides: the zero-padded rows
    return pairs | {
        "fp16 cast, rel_l2 ~3e-4": (normal, normal.half().float()),
        "fp8 e5m2, offset": (offset, quantize(offset, "fp8_e5m2", "tensor")),
    }


@pytest.fixture(params=["numpy", "native"])
def host_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """CPU statistics through NumPy's chunked passes, or through the native one-pass kernel (once it is loaded)."""
    if request.param == "numpy":
        monkeypatch.setattr(native, "_LOADED", None)
    else:
        native.library()
    return str(request.param)


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_chunked_float32_sums_hold_1e6_on_adversarial_inputs(case: str, host_path: str) -> None:
    # 4M-element tensors where float32 accumulation is hardest: wide dynamic range, cosine within 1e-7 of 1, rel_l2
    # down to 1e-10, exact and negated copies. The chunked path must take them (not fall back to float64) and stay
    # within 1e-6 relative of numpy's float64 sums.
    x, q = _adversarial_pairs()[case]
    assert _chunked_stats(x, q, None, None, None, None) is not None
    got = error_stats(x, q).to_dict()
    expected = numpy_stats(x.numpy(), q.numpy(), None)
    for name in ("sum_x2", "sum_q2", "sum_err2", "rel_l2"):
        assert got[name] == pytest.approx(float(expected[name]), rel=1e-6, abs=0), name
    # Σqx and cosine are bounded against the norms (the sum itself may cancel); sqnr in dB.
    norms = math.sqrt(float(expected["sum_x2"]) * float(expected["sum_q2"]))
    assert abs(got["sum_qx"] - float(expected["sum_qx"])) <= 1e-6 * norms
    assert got["cosine"] == pytest.approx(float(expected["cosine"]), rel=0, abs=1e-6)
    assert got["sqnr_db"] == pytest.approx(float(expected["sqnr_db"]), rel=0, abs=1e-5)
    assert got["max_abs_err"] == pytest.approx(float(expected["max_abs_err"]), rel=2**-24, abs=0)
    for name in ("numel", "amax", "nonzero_count", "underflow_count", "overflow_count", "nonfinite_count"):
        assert got[name] == expected[name], name
    if case == "q == x":
        assert (got["rel_l2"], got["cosine"], got["sqnr_db"], got["max_abs"]) == (0.0, 1.0, math.inf, 0.0)
    if case == "q == -x":
        assert got["cosine"] == -1.0


@pytest.mark.parametrize(
    ("name", "x", "q"),
    [*UNSUMMABLE_PAIRS, ("q all zero", torch.tensor([1e-3, 2e-3]), torch.zeros(2))],
)
def test_inputs_outside_the_chunked_range_take_the_float64_path(
    name: str, x: torch.Tensor, q: torch.Tensor, host_path: str
) -> None:
    # Where float32 squares could overflow, lose a sum to underflow, or meet non-finite values, the chunked path
    # declines and the masked float64 computation gives the partial sums (exact against numpy).
    assert _chunked_stats(x, q, None, None, None, None) is None, name
    got = error_stats(x, q).to_dict()
    expected = numpy_stats(x.numpy(), q.numpy(), None)
    for field in ErrorStats.FIELDS:
        assert got[field] == pytest.approx(float(expected[field]), rel=1e-12, abs=0), (name, field)


def test_zero_tensors_stay_on_the_chunked_path() -> None:
    # All-zero x and q (a zero-initialised weight) are exact in float32: no fallback, the documented degenerate values.
    zeros = torch.zeros(4096)
    assert _chunked_stats(zeros, zeros, None, None, None, None) is not None
    values = error_stats(zeros, zeros).to_dict()
    assert (values["rel_l2"], values["cosine"], values["sqnr_db"], values["sum_x2"]) == (0.0, 1.0, math.inf, 0.0)


def test_nan_sums_make_the_ratios_nan() -> None:
    # Sums of unmasked comparisons (the agent's output deviation) are NaN when a tensor holds NaN; the degenerate-case
    # rules (0, 1, ±inf for zero norms) must not read that NaN as a zero norm.
    nan, zero = torch.tensor(float("nan"), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    base = ErrorStats.zeros()
    for field in ("sum_x2", "sum_q2", "sum_qx", "sum_err2"):
        stats = ErrorStats(**{**{name: getattr(base, name) for name in ErrorStats.FIELDS}, field: nan})
        values = stats.to_dict()
        assert math.isnan(values["cosine"]) == (field != "sum_err2"), field
        assert math.isnan(values["rel_l2"]) == (field in ("sum_x2", "sum_err2")), field
        assert math.isnan(values["sqnr_db"]) == (field in ("sum_x2", "sum_err2")), field
    clean = ErrorStats(**{**{name: getattr(base, name) for name in ErrorStats.FIELDS}, "sum_x2": zero})
    assert (clean.to_dict()["rel_l2"], clean.to_dict()["cosine"]) == (0.0, 1.0)


def test_combine_of_parts_equals_the_whole() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 10
    x[17] = float("nan")
    q = quantize(x, "fp8_e4m3")
    whole = error_stats(x, q, "fp8_e4m3")
    parts = [error_stats(xs, qs, "fp8_e4m3") for xs, qs in zip(x.split(137), q.split(137), strict=True)]
    merged = ErrorStats.zeros()
    for part in parts:
        merged = merged.combine(part)
    for name, value in whole.to_dict().items():
        # The whole holds a NaN (masked float64 path); all parts but one take the chunked float32 sums.
        assert merged.to_dict()[name] == pytest.approx(value, rel=tolerance(name, True)), name


def test_tensor_round_trip_and_errors() -> None:
    x = torch.randn(50)
    stats = error_stats(x, quantize(x, "int8", scaling="tensor"))
    vector = stats.as_tensor()
    assert vector.shape == (len(ErrorStats.FIELDS),)
    assert vector.dtype == torch.float64
    assert ErrorStats.from_tensor(vector).to_dict() == stats.to_dict()
    with pytest.raises(ValueError, match="shape"):
        ErrorStats.from_tensor(torch.zeros(3))
    with pytest.raises(TypeError, match="ErrorStats"):
        stats.combine(vector)  # type: ignore[arg-type]


def test_empty_tensor_gives_documented_nan_free_defaults() -> None:
    stats = error_stats(torch.empty(0), torch.empty(0))
    values = stats.to_dict()
    assert values["numel"] == 0
    assert values["rel_l2"] == 0.0
    assert values["cosine"] == 1.0
    assert values["sqnr_db"] == math.inf
    assert values["underflow_ratio"] == 0.0
    assert values["overflow_ratio"] == 0.0
    assert not any(math.isnan(v) for v in values.values())


def test_zero_and_equal_cases() -> None:
    zeros = torch.zeros(4)
    both_zero = error_stats(zeros, zeros).to_dict()
    assert (both_zero["rel_l2"], both_zero["cosine"], both_zero["sqnr_db"]) == (0.0, 1.0, math.inf)
    only_q = error_stats(zeros, torch.ones(4)).to_dict()
    assert (only_q["rel_l2"], only_q["cosine"], only_q["sqnr_db"]) == (math.inf, 0.0, -math.inf)
    x = torch.tensor([1.0, -2.0, 3.0])
    equal = error_stats(x, x.clone()).to_dict()
    assert (equal["rel_l2"], equal["cosine"], equal["sqnr_db"], equal["max_abs"]) == (0.0, 1.0, math.inf, 0.0)
    assert error_stats(x, -x).to_dict()["cosine"] == -1.0


def test_non_saturating_overflow_counts_and_stays_out_of_the_sums() -> None:
    x = torch.tensor([1.0, 1000.0, -2.0])
    q = quantize(x, "fp8_e4m3", saturate=False)
    stats = error_stats(x, q).to_dict()
    assert stats["overflow_count"] == 1
    assert stats["sum_x2"] == 5.0
    assert math.isfinite(stats["rel_l2"])


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        error_stats(torch.ones(3, dtype=torch.int64), torch.ones(3))
    with pytest.raises(ValueError, match="shape"):
        error_stats(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="unknown format"):
        error_stats(torch.ones(3), torch.ones(3), "fp3")


def _pair(seed: int, n: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return x, quantize(x, "fp8_e4m3", "tensor")


def test_batch_defers_cpu_statistics_until_flush() -> None:
    # Inside collecting(), CPU statistics come back NaN and hold what the eager computation gives once flushed, for
    # the chunked sums and for the masked float64 path (a NaN input) alike; outside, nothing is deferred.
    batch = StatsBatch()
    finite = _pair(1)
    with_nan = (finite[0].clone(), finite[1].clone())
    with_nan[0][7] = float("nan")
    with batch.collecting():
        deferred = [error_stats(x, q, "fp8_e4m3") for x, q in (finite, with_nan)]
    eager = error_stats(*finite, "fp8_e4m3")
    assert eager.to_dict()["numel"] == 3000  # computed at once outside the context
    assert len(batch) == 2
    assert all(math.isnan(v) for stats in deferred for v in stats.as_tensor().tolist())
    assert batch.flush() == FlushResult()
    assert len(batch) == 0
    for stats, (x, q) in zip(deferred, (finite, with_nan), strict=True):
        expected = error_stats(x, q, "fp8_e4m3")
        assert torch.equal(stats.as_tensor(), expected.as_tensor())
        assert stats.to_dict() == expected.to_dict()
    assert deferred[1].to_dict()["nonfinite_count"] == 1


def test_batch_leaves_statistics_of_a_tensor_changed_in_place_unfilled() -> None:
    batch = StatsBatch()
    x, q = _pair(2)
    kept = _pair(3)
    with batch.collecting():
        changed = error_stats(x, q)
        fine = error_stats(*kept)
    x.mul_(2.0)
    assert batch.flush() == FlushResult(stale=1)
    assert all(math.isnan(v) for v in changed.as_tensor().tolist())
    assert fine.to_dict() == error_stats(*kept).to_dict()


def test_collecting_is_per_thread_and_nests() -> None:
    outer, inner = StatsBatch(), StatsBatch()
    x, q = _pair(4)
    seen_elsewhere: list[float] = []
    with outer.collecting():
        with inner.collecting():
            error_stats(x, q)
        error_stats(x, q)
        thread = threading.Thread(target=lambda: seen_elsewhere.append(error_stats(x, q).to_dict()["numel"]))
        thread.start()
        thread.join()
    assert (len(outer), len(inner)) == (1, 1)
    assert seen_elsewhere == [3000.0]  # another thread computes at once
    assert error_stats(x, q).to_dict()["numel"] == 3000  # and so does this one after the context


def test_host_stats_hold_the_given_values() -> None:
    batch = StatsBatch()
    fields = [float(i) for i in range(len(ErrorStats.FIELDS))]
    stats = batch.host_stats(fields)
    assert stats.as_tensor().tolist() == fields
    assert [float(getattr(stats, name)) for name in ErrorStats.FIELDS] == fields
    batch.flush()  # rows for the next period are made here; they hold their own values
    again = batch.host_stats([2 * v for v in fields])
    assert again.as_tensor().tolist() == [2 * v for v in fields]
    assert stats.as_tensor().tolist() == fields


@pytest.mark.parametrize("error", [True, False])
def test_comparison_fields_match_numpy(error: bool) -> None:
    x, q = _pair(5, 50_000)
    q = q + 0.3  # not a quantization: a comparison of two tensors
    got = comparison_fields(x.reshape(100, 500), q.reshape(100, 500), error=error)
    x64, q64 = x.double().numpy(), q.double().numpy()
    expected = [x64 @ x64, q64 @ q64, q64 @ x64, ((q64 - x64) ** 2).sum()]
    assert got[0] == 50_000
    for value, reference in zip(got[1:4], expected, strict=False):
        assert value == pytest.approx(float(reference), rel=1e-5)
    if error:
        assert got[4] == pytest.approx(float(expected[3]), rel=1e-5)
    assert [math.isnan(v) for v in got[4:7]] == [not error, True, True]
    assert got[7:] == (0.0, 0.0, 0.0, 0.0)


def test_comparison_fields_of_strided_and_differently_shaped_tensors_match_their_flat_values() -> None:
    # The NumPy views are flattened, never broadcast: a transposed (non-contiguous) reference against a flat value,
    # and a (50, 1) column against a (1, 50) row, compare element by element in storage order of each's values.
    x, q = _pair(6, 1200)
    strided = x.reshape(30, 40).T  # values in the order x.reshape(30, 40).T.reshape(-1)
    got = comparison_fields(strided, q)
    x64, q64 = strided.reshape(-1).double().numpy(), q.double().numpy()
    assert got[1] == pytest.approx(float(x64 @ x64), rel=1e-6)
    assert got[3] == pytest.approx(float(q64 @ x64), rel=1e-6)
    assert got[4] == pytest.approx(float(((q64 - x64) ** 2).sum()), rel=1e-6)
    column, row = x[:50].reshape(50, 1), q[:50].reshape(1, 50)
    flat_err2 = float(((q[:50].double() - x[:50].double()) ** 2).sum())
    assert comparison_fields(column, row)[4] == pytest.approx(flat_err2, rel=1e-6)  # not over 2,500 broadcast pairs
    with pytest.raises(ValueError, match="shape"):
        comparison_fields(x[:50], q[:49])


def test_comparison_fields_of_non_finite_tensors_raise_no_warning() -> None:
    # An infinity in both tensors makes q − x NaN (inf − inf), one in q alone makes it infinite: the sums say so and
    # NumPy's floating-point warnings stay silent (they would raise in a program run with -W error).
    x = torch.ones(1000)
    q = x.clone()
    x[3] = q[3] = float("inf")
    q[5] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        both = comparison_fields(x, q)
        one = comparison_fields(torch.ones(1000), q.nan_to_num(posinf=1.0).index_fill(0, torch.tensor([5]), math.inf))
    assert [math.isinf(both[1]), math.isinf(both[2]), math.isnan(both[4])] == [True, True, True]
    assert [math.isfinite(one[1]), math.isinf(one[2]), math.isinf(one[4])] == [True, True, True]
