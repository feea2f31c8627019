"""Golden spec values, every code point, ties to even, subnormals, saturation and special values."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import torch

from quantwatch.kernels import FORMATS, PRESETS, quantize
from quantwatch.kernels.formats import resolve_format

MINIFLOATS = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "fp4_e1m2"]
WITH_ML_DTYPES = MINIFLOATS[:5]


def q(values: list[float], fmt: str, **kwargs: object) -> list[float]:
    out = quantize(torch.tensor(values, dtype=torch.float32), fmt, **kwargs)  # type: ignore[call-overload]
    return [float(v) for v in out]


@pytest.mark.parametrize(
    ("name", "max_value", "min_normal", "min_subnormal", "emax", "bits"),
    [
        ("fp8_e4m3", 448.0, 2.0**-6, 2.0**-9, 8, 8),
        ("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 15, 8),
        ("fp6_e3m2", 28.0, 2.0**-2, 2.0**-4, 4, 6),
        ("fp6_e2m3", 7.5, 1.0, 0.125, 2, 6),
        ("fp4_e2m1", 6.0, 1.0, 0.5, 2, 4),
        ("fp4_e1m2", 3.5, 2.0, 0.5, 1, 4),
        ("int8", 127.0, 1.0, 1.0, 6, 8),
        ("int4", 7.0, 1.0, 1.0, 2, 4),
        ("e8m0", 2.0**127, 2.0**-127, 2.0**-127, 127, 8),
    ],
)
def test_golden_spec_values(
    name: str, max_value: float, min_normal: float, min_subnormal: float, emax: int, bits: int
) -> None:
    spec = FORMATS[name]
    assert (spec.max_value, spec.min_normal, spec.min_subnormal, spec.emax, spec.bits) == (
        max_value,
        min_normal,
        min_subnormal,
        emax,
        bits,
    )
    # The format's maximum is its own image and is reached by saturation.
    if name == "e8m0":  # unsigned: only the positive side exists
        assert q([max_value, 1e38 * 3], name) == [max_value, max_value]
        return
    assert q([max_value, -max_value], name) == [max_value, -max_value]
    assert q([max_value * 4, -max_value * 4], name, saturate=True) == [max_value, -max_value]


def test_fp4_grids_match_the_issue(oracle: Any) -> None:
    e2m1 = sorted({abs(oracle.decode("fp4_e2m1", c)) for c in oracle.codes("fp4_e2m1")})
    assert e2m1 == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    e1m2 = sorted({abs(oracle.decode("fp4_e1m2", c)) for c in oracle.codes("fp4_e1m2")})
    assert e1m2 == [0.5 * k for k in range(8)]


@pytest.mark.parametrize("name", MINIFLOATS)
def test_every_code_point_is_a_fixed_point(name: str, oracle: Any) -> None:
    values = [oracle.decode(name, c) for c in oracle.codes(name)]
    finite = [v for v in values if math.isfinite(v)]
    assert q(finite, name, saturate=False) == finite
    # The representable set is exactly what the spec decodes: nothing between neighbours survives.
    grid = sorted(set(finite))
    mids_above = [np.nextafter(np.float32(a), np.float32(b)) for a, b in pairwise(grid)]
    assert all(v in grid for v in q([float(m) for m in mids_above], name))


@pytest.mark.parametrize("name", WITH_ML_DTYPES)
def test_code_points_agree_with_ml_dtypes(name: str, oracle: Any) -> None:
    ebits, mbits, _ = oracle.layout[name]
    raw = np.arange(2 ** (1 + ebits + mbits), dtype=np.uint8).view(oracle.ml_dtypes[name]).astype(np.float64)
    ours = np.array([oracle.decode(name, c) for c in oracle.codes(name)])
    np.testing.assert_array_equal(np.isnan(raw), np.isnan(ours))
    np.testing.assert_array_equal(raw[~np.isnan(raw)], ours[~np.isnan(ours)])


@pytest.mark.parametrize("name", MINIFLOATS)
def test_ties_round_to_even_code(name: str, oracle: Any) -> None:
    grid = oracle.positive_grid(name)
    ties, expected, below, above = [], [], [], []
    for (low, low_code), (high, _) in pairwise(grid):
        middle = (low + high) / 2
        ties += [middle, -middle]
        even = low if low_code % 2 == 0 else high
        expected += [even, -even]
        below.append(float(np.nextafter(np.float32(middle), np.float32(0))))
        above.append(float(np.nextafter(np.float32(middle), np.float32(np.inf))))
    assert q(ties, name) == expected
    assert q(below, name) == [low for (low, _), _ in pairwise(grid)]
    assert q(above, name) == [high for _, (high, _) in pairwise(grid)]


def test_subnormals() -> None:
    # E4M3 subnormals are k · 2^-9; half the smallest is a tie that goes to zero (even), 0.75 of it rounds up.
    assert q([2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9], "fp8_e4m3") == [2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9]
    assert q([2.0**-10, 0.75 * 2.0**-9, 1.5 * 2.0**-9], "fp8_e4m3") == [0.0, 2.0**-9, 2 * 2.0**-9]
    assert q([2.0**-17, 3 * 2.0**-17], "fp8_e5m2") == [0.0, 2.0**-15]
    assert q([0.2, 0.3], "fp4_e2m1") == [0.0, 0.5]


def test_overflow_policies() -> None:
    big = [500.0, -1e6, math.inf, -math.inf]
    assert q(big, "fp8_e4m3") == [448.0, -448.0, 448.0, -448.0]
    assert all(math.isnan(v) for v in q(big, "fp8_e4m3", saturate=False))
    # 464 is the tie between 448 and the NaN slot 480: it rounds to the even 448, anything above overflows.
    assert q([464.0], "fp8_e4m3", saturate=False) == [448.0]
    assert math.isnan(q([465.0], "fp8_e4m3", saturate=False)[0])
    assert q([61440.0, -1e9, math.inf], "fp8_e5m2", saturate=False) == [math.inf, -math.inf, math.inf]
    assert q([61439.0], "fp8_e5m2", saturate=False) == [57344.0]
    # FP6/FP4/integers have nothing to overflow to: they saturate either way.
    assert q([100.0, -math.inf], "fp6_e3m2", saturate=False) == [28.0, -28.0]
    assert q([100.0], "fp4_e2m1", saturate=False) == [6.0]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_nan_propagates(name: str) -> None:
    assert math.isnan(q([math.nan], name)[0])


def test_integers_round_half_even_and_are_symmetric() -> None:
    assert q([2.5, 3.5, -2.5, 0.5, 1.49, 200, -200], "int8") == [2, 4, -2, 0, 1, 127, -127]
    assert q([6.5, 7.5, -9, 8], "int4") == [6, 7, -7, 7]


def test_e8m0_is_unsigned_without_zero() -> None:
    assert q([1.0, 3.0, 1.4, 2.0**-140, 2.0**100], "e8m0") == [1.0, 4.0, 1.0, 2.0**-127, 2.0**100]
    assert all(math.isnan(v) for v in q([0.0, -1.0, -0.0], "e8m0"))


def test_unknown_names_list_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"fp8_e4m3.*nvfp4"):
        quantize(torch.ones(3), "fp7")
    with pytest.raises(ValueError, match=r"scaling: .*block:N"):
        quantize(torch.ones(3), "fp8_e4m3", scaling="blocky")
    with pytest.raises(ValueError, match="nearest, stochastic"):
        quantize(torch.ones(3), "fp8_e4m3", rounding="up")
    with pytest.raises(ValueError, match=r"auto, reference, compiled, native, triton"):
        quantize(torch.ones(3), "fp8_e4m3", backend="cuda")
    with pytest.raises(ValueError, match="block size must be an integer"):
        quantize(torch.ones(3), "fp8_e4m3", scaling="block:x")
    with pytest.raises(ValueError, match="fixes scaling nvblock:16"):
        quantize(torch.ones(3), "nvfp4", scaling="tensor")


def test_non_float_inputs_are_type_errors() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(3, dtype=torch.int32), "fp8_e4m3")
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        quantize([1.0, 2.0], "fp8_e4m3")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="format name"):
        resolve_format(3)  # type: ignore[arg-type]


def test_presets_pair_element_and_scaling() -> None:
    assert {name: (p.element.name, p.scaling) for name, p in PRESETS.items()} == {
        "mxfp8": ("fp8_e4m3", "block:32"),
        "mxfp6": ("fp6_e2m3", "block:32"),
        "mxfp4": ("fp4_e2m1", "block:32"),
        "nvfp4": ("fp4_e2m1", "nvblock:16"),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_and_shape_are_kept(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = quantize(x, "fp8_e4m3", scaling="tensor")
    assert out.dtype == dtype
    assert out.shape == x.shape
    # FP8 values times a power-of-two-free FP32 scale, rounded once more into the input dtype.
    expected = quantize(x.float(), "fp8_e4m3", scaling="tensor").to(dtype)
    if dtype != torch.float64:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "limit"), [("int8", 127), ("int4", 7)])
def test_every_integer_code_point_is_a_fixed_point(name: str, limit: int) -> None:
    codes = [float(v) for v in range(-limit, limit + 1)]
    assert q(codes, name) == codes
    assert q([c + 0.25 for c in codes[:-1]], name) == codes[:-1]


def test_every_e8m0_code_point_is_a_fixed_point(oracle: Any) -> None:
    values = np.arange(255, dtype=np.uint8).view(oracle.ml_dtypes["e8m0"]).astype(np.float32)
    assert values.tolist() == [2.0**e for e in range(-127, 128)]
    assert q(values.tolist(), "e8m0") == values.tolist()
