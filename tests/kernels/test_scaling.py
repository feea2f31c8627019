"""Scalings against the spec formulas computed here, stochastic rounding, delayed scaling and error feedback."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from quantwatch.kernels import FORMATS, Quantizer, QuantSpec, quantize

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def cast_np(values: np.ndarray, dtype: type, limit: float) -> np.ndarray:
    """Saturating cast through ml_dtypes (float32 in, float32 out)."""
    return np.clip(values, -limit, limit).astype(np.float32).astype(dtype).astype(np.float32)


def sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * torch.exp2(
        torch.randint(-6, 6, shape, generator=generator).float()
    )


def test_tensor_scaling_is_amax_over_max() -> None:
    x = sample((40, 50), 0)
    details = quantize(x, "fp8_e4m3", scaling="tensor", return_details=True)
    scale = np.float32(x.abs().max().item()) / np.float32(448.0)
    assert details.scale.item() == scale
    expected = cast_np(x.numpy() / scale, E4M3, 448.0) * scale
    np.testing.assert_array_equal(details.values.numpy(), expected)
    assert not details.overflow_mask.any()


def test_tensor_pow2_scale_never_clips() -> None:
    x = sample((1000,), 1)
    details = quantize(x, "fp8_e4m3", scaling="tensor:pow2", return_details=True)
    scale = details.scale.item()
    ideal = x.abs().max().item() / 448.0
    assert math.log2(scale) == round(math.log2(scale))
    assert ideal <= scale < 2 * ideal
    assert not details.overflow_mask.any()


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_channel_scaling_is_tensor_scaling_per_slice(axis: int) -> None:
    x = sample((4, 6, 10), 2)
    details = quantize(x, "int8", scaling=f"channel:{axis}", return_details=True)
    moved = torch.movedim(x, axis, 0)
    expected = torch.stack([quantize(s, "int8", scaling="tensor") for s in moved])
    assert torch.equal(details.values, torch.movedim(expected, 0, axis))
    keep = axis % 3
    assert details.scale.shape == tuple(x.shape[d] if d == keep else 1 for d in range(3))


def mx_reference(x: np.ndarray, block: int, emax: int, dtype: type, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 §6.3, written out: X = 2^(floor(log2 amax) − emax_elem), elements cast with saturation."""
    rows, cols = x.shape
    out = np.empty_like(x)
    scales = np.empty((rows, math.ceil(cols / block)), dtype=np.float32)
    for r in range(rows):
        for b in range(scales.shape[1]):
            chunk = x[r, b * block : (b + 1) * block]
            amax = float(np.abs(chunk).max())
            exponent = math.floor(math.log2(amax)) - emax if amax > 0 else -127
            exponent = min(max(exponent, -127), 127)
            scale = np.float32(2.0**exponent)
            scales[r, b] = scale
            out[r, b * block : (b + 1) * block] = cast_np(chunk / scale, dtype, limit) * scale
    return out, scales


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [("mxfp8", E4M3), ("mxfp6", ml_dtypes.float6_e2m3fn), ("mxfp4", E2M1)],
)
def test_mx_scales_follow_the_spec(preset: str, dtype: type) -> None:
    x = sample((5, 70), 3)  # 70 = two full blocks and a partial one of 6
    x[1, 32:64] = 0.0  # an all-zero block gets the smallest scale
    element = {"mxfp8": "fp8_e4m3", "mxfp6": "fp6_e2m3", "mxfp4": "fp4_e2m1"}[preset]
    spec = FORMATS[element]
    details = quantize(x, preset, return_details=True)
    values, scales = mx_reference(x.numpy(), 32, spec.emax, dtype, spec.max_value)
    np.testing.assert_array_equal(details.scale.numpy(), scales)
    np.testing.assert_array_equal(details.values.numpy(), values)
    assert details.scale[1, 1].item() == 2.0**-127


def test_mx_block_overflow_is_counted() -> None:
    # amax 7.5 → X = 2^(2−2) = 1: 7.5 would round to 8 and is clipped to 6; 6.5 merely rounds to 6.
    x = torch.tensor([[7.5, 6.5, 1.0, 0.1] + [0.0] * 28])
    details = quantize(x, "mxfp4", return_details=True)
    assert details.values[0, :4].tolist() == [6.0, 6.0, 1.0, 0.0]
    assert details.overflow_mask[0, :4].tolist() == [True, False, False, False]
    assert details.underflow_mask[0, :4].tolist() == [False, False, False, True]


def test_nvfp4_two_level_scales_follow_the_formula() -> None:
    x = sample((6, 40), 4)  # 40 = two blocks of 16 and a partial one of 8
    x[2, :16] = 1e-9  # a tiny block hits the E4M3 floor 2^-6 of the block scale
    details = quantize(x, "nvfp4", return_details=True)
    xn = x.numpy()
    tensor_scale = np.float32(np.abs(xn).max()) / np.float32(448.0 * 6.0)
    blocks = np.pad(xn, ((0, 0), (0, 8))).reshape(6, 3, 16)
    block_amax = np.abs(blocks).max(axis=-1, keepdims=True)
    raw = (block_amax / np.float32(6.0)) / tensor_scale
    block_scale = np.clip(raw, np.float32(2.0**-6), np.float32(448.0)).astype(E4M3).astype(np.float32)
    total = tensor_scale * block_scale
    expected = (cast_np(blocks / total, E2M1, 6.0) * total).reshape(6, 48)[:, :40]
    assert details.tensor_scale is not None
    assert details.tensor_scale.item() == tensor_scale
    np.testing.assert_array_equal(details.scale.numpy(), block_scale[..., 0])
    np.testing.assert_array_equal(details.values.numpy(), expected)
    assert details.scale[2, 0].item() == 2.0**-6


def test_stochastic_rounding_is_unbiased_and_seeded() -> None:
    # 1.1 lies between the E4M3 neighbours 1.0 and 1.125: P(up) = 0.8, so E[q] = 1.1.
    n = 400_000
    x = torch.full((n,), 1.1)
    first = quantize(x, "fp8_e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    again = quantize(x, "fp8_e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    other = quantize(x, "fp8_e4m3", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert set(first.unique().tolist()) == {1.0, 1.125}
    p = (1.1 - 1.0) / 0.125
    sigma = 0.125 * math.sqrt(p * (1 - p) / n)
    # Tolerance: 5 standard errors of the mean (≈ 1e-6 chance of a false failure for a fair rounding).
    assert abs(first.double().mean().item() - float(np.float32(1.1))) < 5 * sigma


def test_stochastic_rounding_is_unbiased_for_integers_and_blocks() -> None:
    x = sample((64, 64), 5)
    generator = torch.Generator().manual_seed(9)
    runs = torch.stack([quantize(x, "mxfp4", rounding="stochastic", generator=generator).double() for _ in range(200)])
    nearest = quantize(x, "mxfp4").double()
    # Averaging removes the rounding error (bias of nearest rounding stays); clipped values are biased by design.
    inside = ~quantize(x, "mxfp4", return_details=True).overflow_mask
    error_sr = (runs.mean(0) - x.double())[inside].abs().mean().item()
    error_nearest = (nearest - x.double())[inside].abs().mean().item()
    assert error_sr < 0.2 * error_nearest


def test_delayed_scaling_uses_the_amax_history() -> None:
    quantizer = Quantizer(QuantSpec("fp8_e4m3", scaling="delayed:3"))
    amaxes = [448.0, 896.0, 448.0, 448.0, 448.0, 448.0]
    used = []
    for amax in amaxes:
        x = torch.tensor([amax, 1.0])
        quantizer.quantize(x)
        assert quantizer.last_scale is not None
        used.append(quantizer.last_scale.item())
    # First call: its own amax. Then the max of the previous (up to) 3 amaxes.
    assert used == [1.0, 1.0, 2.0, 2.0, 2.0, 1.0]
    assert quantizer.amax_history.tolist() == [448.0, 448.0, 448.0]
    assert set(quantizer.state_dict()) == {"amax_history", "scale", "calls"}


def test_delayed_scaling_margin_and_stateless_call() -> None:
    quantizer = Quantizer(QuantSpec("fp8_e4m3", scaling="delayed:2:1"))
    quantizer.quantize(torch.tensor([448.0]))
    assert quantizer.scale.item() == 2.0  # amax / max · 2^margin
    stateless = quantize(torch.tensor([448.0, 3.0]), "fp8_e4m3", scaling="delayed:2:1", return_details=True)
    assert stateless.scale.item() == 2.0


def test_delayed_overflow_saturates_until_the_history_catches_up() -> None:
    quantizer = Quantizer(QuantSpec("fp8_e4m3", scaling="delayed:2"))
    quantizer.quantize(torch.tensor([448.0]))
    q, stats = quantizer.quantize(torch.tensor([4480.0]), with_stats=True)
    assert q.item() == 448.0
    assert stats is not None
    assert stats.overflow_count.item() == 1
    q, _ = quantizer.quantize(torch.tensor([4480.0]))
    assert q.item() == 4480.0


def test_error_feedback_removes_the_bias_of_repeated_quantization() -> None:
    x = torch.full((8,), 1.3)  # FP4 E2M1: 1.3 → 1.5 every time without feedback
    plain = Quantizer(QuantSpec("fp4_e2m1", scaling="none"))
    feedback = Quantizer(QuantSpec("fp4_e2m1", scaling="none", error_feedback=True))
    plain_mean = torch.stack([plain.quantize(x)[0] for _ in range(100)]).mean(0)
    feedback_mean = torch.stack([feedback.quantize(x)[0] for _ in range(100)]).mean(0)
    assert torch.allclose(plain_mean, torch.full((8,), 1.5))
    assert (feedback_mean - x).abs().max().item() < 0.01
    feedback.quantize(torch.ones(3))  # a new shape starts a new residual
    assert feedback.residual is not None
    assert feedback.residual.shape == (3,)


def test_empty_and_precomputed_scale() -> None:
    empty = torch.empty(0, 4)
    q, stats = quantize(empty, "nvfp4", with_stats=True)
    assert q.shape == (0, 4)
    assert stats.numel.item() == 0
    x = torch.tensor([1.0, 2.0, 3.0])
    assert quantize(x, "int8", scaling="tensor", scale=torch.tensor(0.5)).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="precomputed scale"):
        quantize(x, "int8", scaling="block:32", scale=torch.tensor(0.5))


def test_nonfinite_inputs_propagate_and_are_counted() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0] + [0.5] * 28)
    details, stats = quantize(x, "mxfp8", return_details=True, with_stats=True)
    assert math.isnan(details.values[1].item())
    assert details.values[2].item() == details.scale[0].item() * 448.0  # saturated at the block's maximum
    assert details.nonfinite_mask.tolist()[:4] == [False, True, True, False]
    assert stats.nonfinite_count.item() == 2
    assert math.isfinite(stats.rel_l2.item())
