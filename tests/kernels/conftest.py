"""Shared helpers of the kernels tests: an independent decoder of every code point, straight from the specs."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from quantwatch.kernels import ErrorStats

# Independent oracles for the formats ml_dtypes implements (OCP OFP8 / OCP MX element and scale formats).
ML_DTYPES = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
}

# (exponent bits, mantissa bits, special-value policy) written down from the specs, not from the package.
SPEC_LAYOUT = {
    "fp8_e4m3": (4, 3, "fn"),
    "fp8_e5m2": (5, 2, "ieee"),
    "fp6_e3m2": (3, 2, "none"),
    "fp6_e2m3": (2, 3, "none"),
    "fp4_e2m1": (2, 1, "none"),
    "fp4_e1m2": (1, 2, "none"),
}


def decode(name: str, code: int) -> float:
    """The value of one bit pattern of a signed minifloat, by the OCP decoding rules."""
    ebits, mbits, policy = SPEC_LAYOUT[name]
    bias = 2 ** (ebits - 1) - 1
    sign = -1.0 if code >> (ebits + mbits) & 1 else 1.0
    exponent_field = (code >> mbits) & (2**ebits - 1)
    mantissa_field = code & (2**mbits - 1)
    all_ones = exponent_field == 2**ebits - 1
    if policy == "ieee" and all_ones:
        return sign * math.inf if mantissa_field == 0 else math.nan
    if policy == "fn" and all_ones and mantissa_field == 2**mbits - 1:
        return math.nan
    if exponent_field == 0:
        return sign * mantissa_field / 2**mbits * 2.0 ** (1 - bias)
    return sign * (1 + mantissa_field / 2**mbits) * 2.0 ** (exponent_field - bias)


def codes(name: str) -> list[int]:
    """Every bit pattern of a minifloat format."""
    ebits, mbits, _ = SPEC_LAYOUT[name]
    return list(range(2 ** (1 + ebits + mbits)))


def positive_grid(name: str) -> list[tuple[float, int]]:
    """(value, code) of every finite non-negative value, ascending."""
    pairs = []
    ebits, mbits, _ = SPEC_LAYOUT[name]
    for code in range(2 ** (ebits + mbits)):
        value = decode(name, code)
        if math.isfinite(value):
            pairs.append((value, code))
    return sorted(pairs)


class SpecOracle:
    """The module's helpers as one object, for tests (pytest's importlib mode cannot import conftest)."""

    ml_dtypes = ML_DTYPES
    layout = SPEC_LAYOUT
    decode = staticmethod(decode)
    codes = staticmethod(codes)
    positive_grid = staticmethod(positive_grid)


def sample(shape: tuple[int, ...], seed: int, special: bool = True) -> torch.Tensor:
    """A seeded tensor spanning 16 binades; with ``special``, its first four values are NaN, +inf, -inf and 0."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-8, 8, shape, generator=generator).float())
    if special:
        flat = x.view(-1)
        flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    return x


def assert_same(fast: tuple[torch.Tensor, ErrorStats], reference: tuple[torch.Tensor, ErrorStats]) -> None:
    """A fast path's (values, stats) against the reference's: values bit-exact, statistics within 1e-6 relative."""
    values, stats = fast
    ref_values, ref_stats = reference
    assert values.dtype == ref_values.dtype
    assert torch.equal(values.nan_to_num(123.0), ref_values.nan_to_num(123.0))
    assert torch.equal(values.isnan(), ref_values.isnan())
    got, expected = stats.as_tensor(), ref_stats.as_tensor()
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)


class BackendCheck:
    """Inputs and the comparison of the fast-path tests (test_backends, and triton_interpreted_checks in the
    process it starts)."""

    sample = staticmethod(sample)
    assert_same = staticmethod(assert_same)


@pytest.fixture
def backends() -> type[BackendCheck]:
    """Seeded inputs and the fast-path-versus-reference comparison."""
    return BackendCheck


@pytest.fixture
def oracle() -> type[SpecOracle]:
    """Independent spec decoding and the ml_dtypes oracles."""
    return SpecOracle


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded numpy generator."""
    return np.random.default_rng(1234)
