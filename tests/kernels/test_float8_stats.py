"""`float8_cast_stats`: a float8 cast's statistics in one native pass, bit for bit those of the tensors' way (the
decoded and divided cast, the mask of the clipped, the native statistics pass)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from quantwatch.kernels import native
from quantwatch.kernels.float8_stats import float8_cast_stats
from quantwatch.kernels.stats import stats_from_masks

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(autouse=True)
def _library() -> None:
    if not native.available():
        pytest.skip("native kernels unavailable")


def _cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """A saturated cast, as torchao's: ``x · scale`` clamped to the format's maximum."""
    fmax = torch.finfo(dtype).max
    return (x * scale).clamp(-fmax, fmax).to(dtype)


def _tensors_way(x: Tensor, codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    fmax = torch.finfo(dtype).max
    return stats_from_masks(x, codes.to(torch.float32) / scale, (x * scale).abs() > fmax).as_tensor()


def _values(rows: int, columns: int, seed: int) -> Tensor:
    """Normal values with zeros, signed zeros, tiny values (subnormal once cast) and a few far beyond the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=g) * torch.logspace(-6, 2, columns)
    flat = x.view(-1)
    flat[:: max(1, flat.numel() // 9)] = 0.0
    flat[1 :: max(1, flat.numel() // 7)] = -0.0
    flat[2 :: max(1, flat.numel() // 5)] = 1.0e-7
    flat[3 :: max(1, flat.numel() // 3)] = 5.0e4
    return x


def _scales(x: Tensor, rowwise: bool, dtype: torch.dtype) -> Tensor:
    """torchao's dynamic scale (``max / amax``) of a tenth of the amax: the largest values clip."""
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    return (torch.finfo(dtype).max / (amax.clamp_min(1e-12) / 10)).to(torch.float32)


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(1, 5), (7, 33), (4, 3, 48), (300, 256)], ids=str)
def test_the_figures_are_the_tensors_way_bit_for_bit(dtype: torch.dtype, rowwise: bool, shape: tuple[int, ...]) -> None:
    x = _values(shape[0], int(torch.tensor(shape[1:]).prod()), seed=len(shape) + shape[0]).reshape(shape)
    scale = _scales(x, rowwise, dtype)
    codes = _cast(x, scale, dtype)
    got = float8_cast_stats(x, codes, scale, torch.finfo(dtype).max)
    assert got is not None
    expected = _tensors_way(x, codes, scale, dtype)
    assert torch.equal(got.as_tensor(), expected)
    assert got.overflow_count.item() > 0  # counted, not only zero
    assert got.underflow_count.item() > 0


def test_every_code_decodes_and_divides_as_torch_does() -> None:
    for dtype in FLOAT8:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        finite = codes[codes.to(torch.float32).isfinite()].reshape(1, -1)
        x = finite.to(torch.float32) * 1.01
        for value in (0.75, 1 / 3, 448 / 0.7071, 3.0e-5):
            for scale in (torch.tensor(value), torch.full((1, 1), value)):  # tensorwise, and one row's scale
                got = float8_cast_stats(x, finite, scale, torch.finfo(dtype).max)
                assert got is not None
                assert torch.equal(got.as_tensor(), _tensors_way(x, finite, scale, dtype))


def test_non_finite_values_and_other_layouts_are_left_to_the_tensors_way() -> None:
    x = _values(8, 40, seed=3)
    scale = _scales(x, False, torch.float8_e4m3fn)
    codes = _cast(x, scale, torch.float8_e4m3fn)
    for bad in (torch.nan, torch.inf, -torch.inf):
        y = x.clone()
        y[2, 5] = bad
        assert float8_cast_stats(y, codes, scale, 448.0) is None
    nan_code = codes.clone()
    nan_code.view(torch.uint8)[1, 1] = 0x7F  # e4m3fn's NaN
    assert float8_cast_stats(x, nan_code, scale, 448.0) is None
    assert float8_cast_stats(x.t(), codes.t(), scale, 448.0) is None  # not contiguous
    assert float8_cast_stats(x, codes, torch.ones(1, 40), 448.0) is None  # a scale per column
    assert float8_cast_stats(x, codes, scale.double(), 448.0) is None
    assert float8_cast_stats(x.double(), codes, scale, 448.0) is None
    assert float8_cast_stats(x, codes.view(torch.uint8), scale, 448.0) is None  # not a float8 tensor
    assert float8_cast_stats(x, codes.view(torch.float8_e4m3fnuz), scale, 240.0) is None  # 0x80 is NaN there
