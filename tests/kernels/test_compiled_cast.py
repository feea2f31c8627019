"""The compiled path's arithmetic cast and unmasked statistics against the reference, bit for bit.

`compiled.cast_nearest` rounds with Veltkamp splitting and a magic-number add instead of bit manipulation; it runs
here compiled (Inductor's flags and vector code are what must be exact) on every rounding case of a band of binades
around each format's range, as does the saturating signed cast of the lane kernels. The fast statistics (no masks,
float32 lanes, checked on the sums) run on finite inputs, hold 1e-6 on adversarial ones, and fall back to the masked
kernels on non-finite ones and outside float32's range.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from quantwatch.kernels import FORMATS, ErrorStats, quantize
from quantwatch.kernels import compiled as compiled_module
from quantwatch.kernels.casts import cast_nearest, cast_saturating
from quantwatch.kernels.compiled import LANE_WIDTH
from quantwatch.kernels.formats import FormatSpec, Kind
from quantwatch.kernels.options import Scaling, ScalingSpec
from quantwatch.kernels.reference import cast_with_overflow
from tests.kernels.conftest import ADVERSARIAL_CASES, UNSUMMABLE_PAIRS, adversarial_pairs

FLOAT_FORMATS = [spec for spec in FORMATS.values() if spec.kind is Kind.FLOAT]


def random_patterns(count: int, seed: int) -> torch.Tensor:
    """Uniformly random float32 bit patterns: every exponent equally likely, NaN payloads included."""
    bits = torch.randint(-(1 << 31), 1 << 31, (count,), generator=torch.Generator().manual_seed(seed))
    return bits.to(torch.int32).view(torch.float32)


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (so the sign of zero counts), any NaN matching any NaN."""
    same = (got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())
    assert bool(same.all()), (got[~same][:5], expected[~same][:5])


def all_casts(v: torch.Tensor) -> list[torch.Tensor]:
    """`cast_nearest` of ``v`` for every float format, saturating and not (one graph, one compilation)."""
    return [cast_nearest(v, fmt, saturate) for fmt in FLOAT_FORMATS for saturate in (True, False)]


def test_cast_nearest_matches_the_reference_on_every_rounding_case(backends: Any) -> None:
    compiled = torch.compile(all_casts, dynamic=True)
    for values in [torch.cat([backends.rounding_cases(fmt) for fmt in FLOAT_FORMATS]), random_patterns(1 << 16, 3)]:
        results = iter(compiled(values))
        for fmt in FLOAT_FORMATS:
            for saturate in (True, False):
                expected, _ = cast_with_overflow(values, fmt, saturate=saturate)
                assert_bitwise_equal(next(results), expected)


def test_cast_nearest_eager_matches_the_reference(backends: Any) -> None:
    for fmt in FLOAT_FORMATS:
        values = backends.rounding_cases(fmt)
        assert_bitwise_equal(cast_nearest(values, fmt, True), cast_with_overflow(values, fmt)[0])


def finite_sample(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Finite values over 16 binades with exact zeros of both signs and a few values far below the rest."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-8, 8, shape, generator=generator).float())
    flat = x.view(-1)
    flat[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-38])
    return x


def kernels_built(monkeypatch: pytest.MonkeyPatch, field: str) -> list[bool]:
    """The ``field`` of every configuration `compiled_for` is asked for from now on, in order (it still builds them)."""
    used: list[bool] = []
    real = compiled_module.compiled_for

    def spy(config: compiled_module.FusedConfig) -> Any:
        used.append(getattr(config, field))
        return real(config)

    monkeypatch.setattr(compiled_module, "compiled_for", spy)
    return used


@pytest.mark.parametrize(
    ("fmt", "scaling", "kwargs", "kernels"),
    [
        ("fp8_e4m3", "tensor", {}, [True]),
        ("mxfp4", None, {}, [True]),
        ("nvfp4", None, {}, [True]),
        # A given scale that clips: overflow counts on the fast path.
        ("fp8_e5m2", "tensor", {"scale": torch.tensor(2.0**-14)}, [True]),
        # Finite inputs that overflow to inf: the sums are not finite, so the masked kernels run after the fast ones.
        ("fp8_e5m2", "none", {"saturate": False}, [True, False]),
    ],
)
def test_compiled_statistics_on_finite_inputs_match_the_reference(
    fmt: str,
    scaling: str | None,
    kwargs: dict[str, Any],
    kernels: list[bool],
    backends: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    used = kernels_built(monkeypatch, "assume_finite")
    x = finite_sample((33, 70), 11)
    if scaling == "none":
        x = x * 2.0**12
    fast = quantize(x, fmt, scaling, with_stats=True, backend="compiled", **kwargs)
    assert used == kernels
    ref = quantize(x, fmt, scaling, with_stats=True, backend="reference", **kwargs)
    backends.assert_same(fast, ref)
    assert_bitwise_equal(fast[0], ref[0])
    counts = ref[1].to_dict()
    assert counts["underflow_count"] > 0
    if "scale" in kwargs or "saturate" in kwargs:
        assert counts["overflow_count"] > 0


def below_overflow(fmt: FormatSpec) -> float:
    """The largest float32 that rounds to at most the format's maximum (the overflow threshold, or just below it)."""
    threshold, ties_up = compiled_module.overflow_threshold(fmt)
    if not ties_up:
        return threshold
    return float(torch.nextafter(torch.tensor(threshold), torch.tensor(0.0)))


def saturating_casts(v: torch.Tensor, unit: torch.Tensor) -> list[torch.Tensor]:
    """`cast_saturating` of every float format: clamped on ``v``, unclamped on ``unit`` (|unit| ≤ 1) scaled up to
    the largest value that rounds to at most the maximum."""
    return [cast_saturating(v, fmt) for fmt in FLOAT_FORMATS] + [
        cast_saturating(unit * below_overflow(fmt), fmt, clamp=False) for fmt in FLOAT_FORMATS
    ]


def test_cast_saturating_matches_the_reference_on_every_finite_rounding_case(backends: Any) -> None:
    # The lane kernels' cast rounds signed values; zeros keep their sign through `round`, and clamping is saturation.
    compiled = torch.compile(saturating_casts, dynamic=True)
    for values in [torch.cat([backends.rounding_cases(fmt) for fmt in FLOAT_FORMATS]), random_patterns(1 << 16, 4)]:
        finite = values[torch.isfinite(values)]
        # Every rounding case scaled into [-1, 1] (±1 exactly at the largest), for the values no clamp may meet.
        unit = finite / finite.abs().amax()
        results = iter(compiled(finite, unit))
        for fmt in FLOAT_FORMATS:
            assert_bitwise_equal(next(results), cast_with_overflow(finite, fmt, saturate=True)[0])
        for fmt in FLOAT_FORMATS:
            unclamped = unit * below_overflow(fmt)
            expected, overflow = cast_with_overflow(unclamped, fmt, saturate=True)
            assert not bool(overflow.any())
            assert_bitwise_equal(next(results), expected)


LANE_CASES = [*ADVERSARIAL_CASES, "near float32 underflow", "same sign, one magnitude"]


@functools.cache
def _lane_pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pairs = adversarial_pairs(9, (1 << 22) + 37)  # not a whole number of lane groups: the last one is zero-padded
    normal = pairs["q == x"][0]
    # Squares below float32's normal range (|x| < 2^-63) everywhere but one element in 1024, which carries the sums.
    tiny = normal * 2.0**-70
    tiny[::1024] *= 2.0**50
    # Same-sign values of one magnitude: where a float32 running sum loses the most.
    offset = 1 + 1e-3 * normal
    return pairs | {
        "near float32 underflow": (tiny, quantize(tiny, "fp8_e4m3", "tensor")),
        "same sign, one magnitude": (offset, quantize(offset, "fp8_e5m2", "tensor")),
    }


def flat_lane_stats(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`lane_stats` of flat x and q, as the lane kernels lay them out (no overflow mask)."""
    spec = ScalingSpec(Scaling.NONE)
    padded = compiled_module.padded_flat(x, spec, LANE_WIDTH)
    xs = compiled_module.lanes(padded, LANE_WIDTH)
    qs = compiled_module.lanes(compiled_module.padded_flat(q, spec, LANE_WIDTH), LANE_WIDTH)
    return compiled_module.lane_stats(xs, qs, None, x.abs().amax(), x.numel(), padded.numel())


@pytest.mark.parametrize("case", LANE_CASES)
def test_lane_statistics_hold_1e6_on_adversarial_inputs(case: str, backends: Any) -> None:
    # 4M-element pairs where float32 products and sums are hardest: wide dynamic range, products that underflow,
    # cosine within 1e-7 of 1, rel_l2 down to 1e-10, exact and negated copies. Compiled (Inductor's code is what
    # must hold) and checked against numpy's float64.
    x, q = _lane_pairs()[case]
    stats = torch.compile(flat_lane_stats, dynamic=True)(x, q).tolist()
    assert compiled_module.lane_sums_in_range(stats)
    backends.assert_fields_match_float64(stats, x, q)
    got = dict(zip(ErrorStats.FIELDS, stats, strict=True))
    derived = ErrorStats.from_tensor(torch.tensor(stats)).to_dict()
    if case == "q == x":
        assert (derived["rel_l2"], derived["cosine"], derived["sqnr_db"], derived["max_abs"]) == (
            0.0,
            1.0,
            math.inf,
            0.0,
        )
    if case == "q == -x":
        assert derived["cosine"] == -1.0
    if case == "near float32 underflow":
        assert got["underflow_count"] > 0


@pytest.mark.parametrize(
    ("name", "x", "q"),
    UNSUMMABLE_PAIRS,
)
def test_lane_range_check_rejects_what_float32_cannot_sum(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    assert not compiled_module.lane_sums_in_range(flat_lane_stats(x, q).tolist()), name


def test_compiled_statistics_below_the_float32_range_rerun_masked(
    backends: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every square below float32's normal range: the lane sums would lose them, so the masked float64 kernels rerun.
    used = kernels_built(monkeypatch, "lanes")
    x = finite_sample((33, 70), 12) * 2.0**-70
    fast = quantize(x, "fp8_e4m3", "tensor", with_stats=True, backend="compiled")
    assert used == [True, False]
    ref = quantize(x, "fp8_e4m3", "tensor", with_stats=True, backend="reference")
    backends.assert_same(fast, ref)
    assert_bitwise_equal(fast[0], ref[0])


def test_nvfp4_lanes_never_clip_even_where_block_scales_round_down(backends: Any) -> None:
    # The lane kernels count no NVFP4 overflows: a block scale rounds to E4M3 at most 2^-4 below its exact value, so
    # |x / scale| stays below 7. Block amaxes swept across whole E4M3 rounding intervals, from just past each tie
    # (the scale rounds down the most) in every binade the block scales span, hold that against the reference.
    x = backends.nvfp4_block_sweep()
    fast = quantize(x, "nvfp4", with_stats=True, backend="compiled")
    ref = quantize(x, "nvfp4", with_stats=True, backend="reference")
    backends.assert_same(fast, ref)
    assert ref[1].to_dict()["overflow_count"] == 0
