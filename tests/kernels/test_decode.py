"""`float8_to_float32`: torch's own conversion of float8 tensors, bit for bit, in one native pass."""

from __future__ import annotations

import pytest
import torch

from quantwatch.kernels import native
from quantwatch.kernels.decode import float8_to_float32

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


@pytest.fixture(autouse=True)
def _library() -> None:
    if not native.available():
        pytest.skip("native kernels unavailable")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # NaNs compared by their bits too


@pytest.mark.parametrize("dtype", FLOAT8)
def test_every_code_and_a_large_tensor_decode_as_torch_converts(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    got = float8_to_float32(codes)
    assert got is not None
    assert torch.equal(bits(got), bits(codes.to(torch.float32)))
    x = (torch.randn(300, 700, generator=torch.Generator().manual_seed(1)) * 30).to(dtype)  # over the parallel size
    got = float8_to_float32(x)
    assert got is not None
    assert torch.equal(bits(got), bits(x.to(torch.float32)))


def test_a_transposed_matrix_keeps_its_layout_and_values() -> None:
    w = torch.randn(64, 48).to(torch.float8_e4m3fn).t()
    got = float8_to_float32(w)
    assert got is not None
    assert got.stride() == w.stride()
    assert torch.equal(got, w.to(torch.float32))


def test_what_it_does_not_decode_is_left_to_torch() -> None:
    assert float8_to_float32(torch.randn(8, 8)) is None  # not float8
    assert float8_to_float32(torch.randn(8, 8).to(torch.float8_e4m3fn)[:, ::2]) is None  # not dense


@pytest.mark.parametrize("dtype", FLOAT8)
def test_a_divisor_divides_as_torch_divides_the_converted_values(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    x = (torch.randn(300, 700, generator=torch.Generator().manual_seed(2)) * 30).to(dtype)
    for value in (1 / 3, 448 / 0.7071, 3.0e-30, 7.0e30):
        divisor = torch.tensor(value, dtype=torch.float32)
        for t in (codes, x[:64, :48].contiguous().t(), *([x] if value == 1 / 3 else [])):  # x: over the parallel size
            got = float8_to_float32(t, divisor)
            assert got is not None
            assert torch.equal(bits(got), bits(t.to(torch.float32) / divisor))
    assert float8_to_float32(codes, torch.ones(2)) is None  # one divisor for all only
    assert float8_to_float32(codes, torch.ones((), dtype=torch.float64)) is None
