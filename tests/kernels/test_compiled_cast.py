"""The compiled path's arithmetic cast and unmasked statistics against the reference, bit for bit.

`compiled.cast_nearest` rounds with Veltkamp splitting and a magic-number add instead of bit manipulation; it runs
here compiled (Inductor's flags and vector code are what must be exact) on every rounding case of a band of binades
around each format's range. The fast statistics (no masks, checked on the sums) run on finite inputs and fall back
to the masked kernels on non-finite ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quantwatch.kernels import FORMATS, quantize
from quantwatch.kernels import compiled as compiled_module
from quantwatch.kernels.compiled import cast_nearest, cast_saturating
from quantwatch.kernels.formats import FormatSpec, Kind
from quantwatch.kernels.reference import cast_with_overflow

FLOAT_FORMATS = [spec for spec in FORMATS.values() if spec.kind is Kind.FLOAT]


def rounding_cases(fmt: FormatSpec) -> torch.Tensor:
    """Every float32 binade from below the format's subnormals to above its maximum, with each mantissa prefix one
    bit longer than the format's and every low-bit pattern that decides a rounding (zero: a tie or exact; one; all
    ones; the half point and its neighbours), both signs; plus zeros, float32 subnormals, ±inf and NaN."""
    drop = 22 - fmt.mantissa_bits
    prefixes = torch.arange(1 << (fmt.mantissa_bits + 1), dtype=torch.int64) << drop
    low = torch.tensor([0, 1, 2, (1 << drop) - 1, (1 << (drop - 1)) - 1, 1 << (drop - 1), (1 << (drop - 1)) + 1])
    mantissas = (prefixes[:, None] | low[None, :]).reshape(-1)
    fields = torch.arange(127 + fmt.emin - fmt.mantissa_bits - 4, 127 + fmt.emax + 4, dtype=torch.int64)
    bits = ((fields[:, None] << 23) | mantissas[None, :]).reshape(-1)
    subnormal = torch.tensor([0, 1, 2, 0x400000, 0x7FFFFF], dtype=torch.int64)
    special = torch.tensor([0x7F800000, 0x7FC00000, 0x7F800001], dtype=torch.int64)
    positive = torch.cat([bits, subnormal, special])
    patterns = torch.cat([positive, positive | (1 << 31)])
    return torch.where(patterns >= 1 << 31, patterns - (1 << 32), patterns).to(torch.int32).view(torch.float32)


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


def test_cast_nearest_matches_the_reference_on_every_rounding_case() -> None:
    compiled = torch.compile(all_casts, dynamic=True)
    for values in [torch.cat([rounding_cases(fmt) for fmt in FLOAT_FORMATS]), random_patterns(1 << 16, 3)]:
        results = iter(compiled(values))
        for fmt in FLOAT_FORMATS:
            for saturate in (True, False):
                expected, _ = cast_with_overflow(values, fmt, saturate=saturate)
                assert_bitwise_equal(next(results), expected)


def test_cast_nearest_eager_matches_the_reference() -> None:
    for fmt in FLOAT_FORMATS:
        values = rounding_cases(fmt)
        assert_bitwise_equal(cast_nearest(values, fmt, True), cast_with_overflow(values, fmt)[0])


def finite_sample(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Finite values over 16 binades with exact zeros of both signs and a few values far below the rest."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-8, 8, shape, generator=generator).float())
    flat = x.view(-1)
    flat[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-38])
    return x


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
    used: list[bool] = []
    real = compiled_module.compiled_for

    def spy(config: compiled_module.FusedConfig) -> Any:
        used.append(config.assume_finite)
        return real(config)

    monkeypatch.setattr(compiled_module, "compiled_for", spy)
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


def saturating_casts(v: torch.Tensor, small: torch.Tensor) -> list[torch.Tensor]:
    """`cast_saturating` of every float format: clamped on ``v``, unclamped on ``small`` (|small| ≤ max(1 + 2^-22))."""
    return [cast_saturating(v, fmt) for fmt in FLOAT_FORMATS] + [
        cast_saturating(small * fmt.max_value, fmt, clamp=False) for fmt in FLOAT_FORMATS
    ]


def test_cast_saturating_matches_the_reference_on_every_finite_rounding_case() -> None:
    # The lane kernels' cast rounds signed values; zeros keep their sign through `round`, and clamping is saturation.
    compiled = torch.compile(saturating_casts, dynamic=True)
    for values in [torch.cat([rounding_cases(fmt) for fmt in FLOAT_FORMATS]), random_patterns(1 << 16, 4)]:
        finite = values[torch.isfinite(values)]
        # Every rounding case scaled into [-1, 1], and the largest inputs a scale from the amax can give.
        small = torch.cat([finite / finite.abs().amax(), torch.tensor([1 + 2.0**-22, -(1 + 2.0**-22)])])
        results = iter(compiled(finite, small))
        for fmt in FLOAT_FORMATS:
            assert_bitwise_equal(next(results), cast_with_overflow(finite, fmt, saturate=True)[0])
        for fmt in FLOAT_FORMATS:
            assert_bitwise_equal(next(results), cast_with_overflow(small * fmt.max_value, fmt, saturate=True)[0])
