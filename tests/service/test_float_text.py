"""The vectorised float32 spelling, value by value against numpy's shortest decimal spelled by prometheus_client."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from prometheus_client.utils import floatToGoString

from quantwatch.service.float_text import _shortest_decimals, float32_value_lines


def reference(values: npt.NDArray[np.float32]) -> list[bytes]:
    """What prometheus_client writes for the float64 of numpy's shortest float32 decimal, one value at a time."""
    return [(floatToGoString(float(str(np.float32(v)))) + "\n").encode() for v in values.tolist()]


def neighbours(values: npt.NDArray[np.float32], ulps: int) -> npt.NDArray[np.float32]:
    """Each finite value and the float32s up to ``ulps`` steps either side of it."""
    bits = values[np.isfinite(values)].view(np.uint32).astype(np.int64)
    near = np.concatenate([bits + k for k in range(-ulps, ulps + 1)])
    return near[(near >= 0) & (near < 2**31)].astype(np.uint32).view(np.float32)


def both_signs(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return np.concatenate([values, -values])


def test_random_bit_patterns_of_every_class() -> None:
    # Normal, subnormal, zero, infinite and NaN figures, in proportion to their share of the float32 codes.
    bits = np.random.default_rng(11).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = np.where(np.isnan(values), np.float32(np.nan), values)  # quiet NaNs: the ingest path widens them
    assert float32_value_lines(values) == reference(values)


def test_random_figures_in_the_ranges_metrics_take() -> None:
    rng = np.random.default_rng(12)
    values = np.concatenate(
        [
            rng.random(50_000, dtype=np.float32),  # ratios
            (1 - rng.random(20_000) * 1e-3).astype(np.float32),  # cosines near 1
            (rng.standard_normal(20_000) * 30).astype(np.float32),  # SQNR in dB
            (10.0 ** rng.uniform(-13, 6, 50_000)).astype(np.float32),  # amax, scales, small ratios
        ]
    )
    values = both_signs(values)
    assert float32_value_lines(values) == reference(values)


def test_the_fast_path_spells_nearly_every_value_in_its_range() -> None:
    # Otherwise the tests above would pass on numpy's per-value path alone.
    values = (10.0 ** np.random.default_rng(13).uniform(-13, 6, 100_000)).astype(np.float32)
    _, _, found = _shortest_decimals(values)
    assert found.mean() > 0.99


def test_powers_of_two_and_their_neighbours_across_the_whole_range() -> None:
    # A power of two has a lopsided rounding interval: half as wide below as above.
    with np.errstate(over="ignore"):
        powers = np.exp2(np.arange(-149, 128, dtype=np.float64)).astype(np.float32)
    values = both_signs(neighbours(powers, 2))
    assert float32_value_lines(values) == reference(values)


def test_powers_of_ten_and_their_neighbours_across_the_whole_range() -> None:
    # Where the decimal exponent of a figure is closest to changing, and where a candidate rounds up to 10**k.
    with np.errstate(over="ignore"):
        powers = (10.0 ** np.arange(-45, 39, dtype=np.float64)).astype(np.float32)
    values = both_signs(neighbours(powers, 3))
    assert float32_value_lines(values) == reference(values)


def test_ties_boundaries_and_special_values() -> None:
    values = np.array(
        [
            0.0,
            -0.0,
            np.nan,
            np.inf,
            -np.inf,
            4707.21875,  # 9 exact digits, two 8-digit decimals equally near: Dragon4 takes the even one
            44868.3125,
            15.0,
            0.5,
            1e-4,
            1e-13,
            9.999999e-14,
            999999.94,
            1e6,
            1e16,
            3.4028235e38,
            1.4e-45,
            1.1754944e-38,
            0.1,
            0.3,
            2.0 / 3.0,
        ],
        dtype=np.float32,
    )
    values = both_signs(values)
    assert float32_value_lines(values) == reference(values)


def test_float64_input_is_rounded_to_float32_first() -> None:
    assert float32_value_lines(np.array([0.1, 1 / 3, 1e-30, 123456789.0])) == [
        b"0.1\n",
        b"0.33333334\n",
        b"1e-30\n",
        b"1.2345679e+08\n",  # float32 123456792: its shortest decimal has 8 digits
    ]
