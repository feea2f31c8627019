"""Shared helpers of the kernels tests: an independent decoder of every code point, straight from the specs."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from quantwatch.kernels import ErrorStats, quantize
from quantwatch.kernels.formats import FormatSpec

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


def assert_fields_match_float64(
    fields: list[float], x: torch.Tensor, q: torch.Tensor, overflow: torch.Tensor | None = None
) -> None:
    """`ErrorStats` fields (``FIELDS`` order) of finite x and q against numpy's float64: sums within 1e-6 (Σqx
    against the norms, since it may cancel), the largest error within one float32 rounding, the rest exact."""
    got = dict(zip(ErrorStats.FIELDS, fields, strict=True))
    x64, q64 = x.double().numpy(), q.double().numpy()
    err = q64 - x64
    expected = {"sum_x2": (x64 * x64).sum(), "sum_q2": (q64 * q64).sum(), "sum_err2": (err * err).sum()}
    for name, value in expected.items():
        assert got[name] == pytest.approx(float(value), rel=1e-6, abs=0), name
    assert abs(got["sum_qx"] - float((q64 * x64).sum())) <= 1e-6 * math.sqrt(expected["sum_x2"] * expected["sum_q2"])
    assert got["max_abs_err"] == pytest.approx(float(np.abs(err).max()), rel=2**-24, abs=0)
    assert got["amax"] == float(np.abs(x64).max())
    assert got["nonzero_count"] == int((x64 != 0).sum())
    assert got["underflow_count"] == int(((x64 != 0) & (q64 == 0)).sum())
    assert got["overflow_count"] == (int(overflow.sum()) if overflow is not None else 0)
    assert (got["numel"], got["nonfinite_count"]) == (x.numel(), 0)


def rounding_cases(fmt: FormatSpec, finite: bool = False) -> torch.Tensor:
    """Every float32 binade from below the format's subnormals to above its maximum, with each mantissa prefix one
    bit longer than the format's and every low-bit pattern that decides a rounding (zero: a tie or exact; one; all
    ones; the half point and its neighbours), both signs; plus zeros, float32 subnormals and (unless ``finite``)
    ±inf and NaN."""
    drop = 22 - fmt.mantissa_bits
    prefixes = torch.arange(1 << (fmt.mantissa_bits + 1), dtype=torch.int64) << drop
    low = torch.tensor([0, 1, 2, (1 << drop) - 1, (1 << (drop - 1)) - 1, 1 << (drop - 1), (1 << (drop - 1)) + 1])
    mantissas = (prefixes[:, None] | low[None, :]).reshape(-1)
    fields = torch.arange(127 + fmt.emin - fmt.mantissa_bits - 4, 127 + fmt.emax + 4, dtype=torch.int64)
    bits = ((fields[:, None] << 23) | mantissas[None, :]).reshape(-1)
    subnormal = torch.tensor([0, 1, 2, 0x400000, 0x7FFFFF], dtype=torch.int64)
    special = torch.tensor([] if finite else [0x7F800000, 0x7FC00000, 0x7F800001], dtype=torch.int64)
    positive = torch.cat([bits, subnormal, special])
    patterns = torch.cat([positive, positive | (1 << 31)])
    return torch.where(patterns >= 1 << 31, patterns - (1 << 32), patterns).to(torch.int32).view(torch.float32)


def nvfp4_block_sweep() -> torch.Tensor:
    """NVFP4 blocks whose amaxes sweep whole E4M3 rounding intervals, from just past each tie (where the block scale
    rounds down the most) in every binade the block scales span: where an E2M1 value would clip if any could."""
    generator = torch.Generator().manual_seed(13)
    steps = torch.arange(256, dtype=torch.float32)
    block_amax = (1 + steps / 256) * torch.exp2(torch.arange(-12, 9, dtype=torch.float32))[:, None]
    blocks = torch.rand((*block_amax.shape, 16), generator=generator) * block_amax[..., None]
    blocks[..., 3] = block_amax
    return blocks.reshape(-1, 64).contiguous()


ADVERSARIAL_CASES = ("fp8 e4m3, tensor scale", "nvfp4, wide range", "one element one ulp off", "q == x", "q == -x")


def adversarial_pairs(seed: int, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(x, q)`` pairs of ``n`` elements where float32 sums are hardest, by the names of ADVERSARIAL_CASES: cosine
    within 1e-7 of 1, rel_l2 down to 1e-10, exact and negated copies, and magnitudes from 1e-15 to 1e11 (squares
    spanning 52 decades, most of them below float32's). ``"q == x"`` pairs the plain normal sample with its copy."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen)
    wide = normal * 10.0 ** (torch.rand(n, generator=gen) * 26 - 15)
    one_ulp = normal.clone()
    one_ulp[12345] = torch.nextafter(one_ulp[12345], torch.tensor(torch.inf))
    pairs = [
        (normal, quantize(normal, "fp8_e4m3", "tensor")),
        (wide, quantize(wide, "nvfp4")),
        (normal, one_ulp),
        (normal, normal.clone()),
        (wide, -wide),
    ]
    return dict(zip(ADVERSARIAL_CASES, pairs, strict=True))


# (name, x, q) whose statistics float32 sums cannot hold: non-finite values, magnitudes beyond 2^40, squares below
# float32's range.
UNSUMMABLE_PAIRS = [
    ("NaN in x", torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([1.0, 0.0, 2.0])),
    ("inf in q", torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("inf")])),
    ("|x| above 2^40", torch.tensor([1.0, 2.0**41]), torch.tensor([1.0, 2.0**41])),
    ("tiny errors only", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 2.0**-22]) * 2.0**-60),
    ("squares underflow", torch.full((4,), 1e-30), torch.full((4,), 1.5e-30)),
]


class BackendCheck:
    """Inputs and the comparison of the fast-path tests (test_backends, and triton_interpreted_checks in the
    process it starts)."""

    sample = staticmethod(sample)
    assert_same = staticmethod(assert_same)
    nvfp4_block_sweep = staticmethod(nvfp4_block_sweep)
    rounding_cases = staticmethod(rounding_cases)
    assert_fields_match_float64 = staticmethod(assert_fields_match_float64)


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
