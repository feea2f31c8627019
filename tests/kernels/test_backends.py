"""Fast paths against the reference: values and scales bit-exact, statistics within 1e-6 relative.

torch.compile takes seconds per configuration on these CPUs, so the compiled path is checked on a few
configurations that together cover every scaling kind, stochastic rounding, non-finite inputs and partial blocks.
The Triton kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from quantwatch.kernels import FORMATS, BackendUnavailableError, quantize
from quantwatch.kernels import api as api_module
from quantwatch.kernels import compiled as compiled_module

CASES = [
    # (format, scaling, rounding, saturate, dtype, shapes): together every scaling kind, both roundings, both
    # saturation modes, a 16-bit input, partial blocks, and a shape change that reuses the compiled kernels.
    ("fp8_e4m3", "tensor", "nearest", False, torch.float32, [(64, 96), (33, 70)]),
    ("nvfp4", None, "nearest", True, torch.float32, [(33, 70)]),
    ("int8", "channel:1", "stochastic", True, torch.bfloat16, [(33, 70)]),
    # Stochastic rounding on the float32 lane kernels: the noise is padded and sliced like x.
    ("fp4_e2m1", "tensor", "stochastic", True, torch.float32, [(33, 70)]),
]


@pytest.mark.parametrize(("fmt", "scaling", "rounding", "saturate", "dtype", "shapes"), CASES)
def test_compiled_matches_reference(
    fmt: str,
    scaling: str | None,
    rounding: str,
    saturate: bool,
    dtype: torch.dtype,
    shapes: list[tuple[int, int]],
    backends: Any,
) -> None:
    for seed, shape in enumerate(shapes):
        x = backends.sample(shape, seed).to(dtype)
        kwargs = {"scaling": scaling, "rounding": rounding, "saturate": saturate, "with_stats": True}
        fast = quantize(x, fmt, backend="compiled", generator=torch.Generator().manual_seed(5), **kwargs)  # type: ignore[call-overload]
        ref = quantize(x, fmt, backend="reference", generator=torch.Generator().manual_seed(5), **kwargs)  # type: ignore[call-overload]
        backends.assert_same(fast, ref)


def test_auto_uses_the_compiled_path_for_large_tensors(monkeypatch: pytest.MonkeyPatch, backends: Any) -> None:
    calls = []
    real = compiled_module.quantize_fused

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compiled_module, "quantize_fused", spy)
    monkeypatch.setattr(api_module, "AUTO_COMPILE_MIN_NUMEL", 1000)
    small = backends.sample((10, 10), 2)
    large = backends.sample((40, 40), 3)  # 40 columns: one full MX block and a partial one
    quantize(small, "mxfp4", with_stats=True)
    assert calls == []
    fast = quantize(large, "mxfp4", with_stats=True)
    assert len(calls) == 1
    backends.assert_same(fast, quantize(large, "mxfp4", with_stats=True, backend="reference"))


def test_auto_falls_back_when_compilation_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, backends: Any
) -> None:
    def broken(config: object) -> object:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_module, "compiled_for", broken)
    monkeypatch.setattr(api_module, "AUTO_COMPILE_MIN_NUMEL", 1)
    monkeypatch.setattr(api_module, "AUTO_NATIVE_MIN_NUMEL", 1 << 40)  # past the native kernels, to the compiled
    x = backends.sample((8, 8), 4)
    with caplog.at_level(logging.WARNING):
        values = quantize(x, "fp8_e4m3", scaling="tensor")
    assert torch.equal(
        values.nan_to_num(1.0), quantize(x, "fp8_e4m3", scaling="tensor", backend="reference").nan_to_num(1.0)
    )
    assert "compiled backend unavailable" in caplog.text
    with pytest.raises(BackendUnavailableError, match="no C\\+\\+ compiler"):
        quantize(x, "fp8_e4m3", scaling="tensor", backend="compiled")


def test_unavailable_explicit_backends_raise_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 4)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        quantize(x, "fp8_e4m3", backend="triton")
    with pytest.raises(BackendUnavailableError, match="float64"):
        quantize(x.double(), "fp8_e4m3", backend="compiled")
    with pytest.raises(BackendUnavailableError, match="e8m0"):
        quantize(x.abs(), "e8m0", backend="compiled")
    with pytest.raises(BackendUnavailableError, match="reference backend only"):
        quantize(x, "fp8_e4m3", backend="compiled", return_details=True)


def test_triton_kernels_match_reference_in_the_interpreter() -> None:
    # Triton picks compile-or-interpret when it is first imported (torch imports it early), so the interpreted
    # checks run in a fresh process with TRITON_INTERPRET=1 from the start.
    pytest.importorskip("triton", reason="triton is part of the dev extra on Linux x86-64 only")
    checks = Path(__file__).with_name("triton_interpreted_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(checks), "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.parametrize(
    "fmt", ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "fp4_e1m2", "int8", "int4"]
)
def test_input_side_overflow_mask_equals_the_casts(fmt: str) -> None:
    spec = FORMATS[fmt]
    threshold, _ = compiled_module.overflow_threshold(spec)
    near = torch.tensor([threshold, spec.max_value, 2 * spec.max_value, float("inf"), float("nan"), 0.0])
    values = torch.cat([near, near.nextafter(torch.tensor(0.0)), near.nextafter(torch.tensor(float("inf")))])
    values = torch.cat([values, -values])
    expected = compiled_module.cast_bits(values, spec, True, None)[1]
    assert torch.equal(compiled_module.nearest_overflow(values, spec), expected)
    assert expected.any()
