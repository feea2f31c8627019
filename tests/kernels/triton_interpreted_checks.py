"""Triton kernels against the reference, run by test_backends in a process started with TRITON_INTERPRET=1.

Not collected by the main test run (the name does not start with ``test_``): Triton must see the variable before it
is first imported, which a process that already imported torch cannot guarantee.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from quantwatch.kernels import BackendUnavailableError, quantize

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_backends only")


TRITON_CASES = [
    ("fp8_e4m3", "tensor", "nearest", True, torch.float32),
    ("fp8_e5m2", "none", "nearest", False, torch.float32),
    ("fp6_e3m2", "tensor:pow2", "nearest", True, torch.float16),
    ("int4", "delayed:4:1", "stochastic", True, torch.float32),
    ("mxfp4", None, "nearest", True, torch.float32),
    ("mxfp8", None, "stochastic", True, torch.bfloat16),
    ("nvfp4", None, "nearest", True, torch.float32),
    ("fp4_e1m2", "block:20", "nearest", True, torch.float32),
]


@pytest.mark.parametrize(("fmt", "scaling", "rounding", "saturate", "dtype"), TRITON_CASES)
def test_triton_matches_reference(
    fmt: str, scaling: str | None, rounding: str, saturate: bool, dtype: torch.dtype, backends: Any
) -> None:
    x = backends.sample((33, 70), 6).to(dtype)
    kwargs = {"scaling": scaling, "rounding": rounding, "saturate": saturate, "with_stats": True}
    fast = quantize(x, fmt, backend="triton", generator=torch.Generator().manual_seed(5), **kwargs)  # type: ignore[call-overload]
    ref = quantize(x, fmt, backend="reference", generator=torch.Generator().manual_seed(5), **kwargs)  # type: ignore[call-overload]
    backends.assert_same(fast, ref)


def test_triton_without_stats_and_channel_scaling(backends: Any) -> None:
    x = backends.sample((5, 40), 7, special=False)
    assert torch.equal(quantize(x, "nvfp4", backend="triton"), quantize(x, "nvfp4", backend="reference"))
    with pytest.raises(BackendUnavailableError, match="channel"):
        quantize(x, "int8", scaling="channel", backend="triton")


def test_the_interpreter_is_what_ran() -> None:
    from quantwatch.kernels import triton_kernels

    assert type(triton_kernels.flat_kernel).__name__ == "InterpretedFunction"
