"""The protocol every fast path implements (native CPU kernels, torch.compile, Triton), and the checks built on it.

A fast path is a module (`native`, `compiled`, `triton_path`) with the members of `FastPath`; `api` keeps the table
that says which one `auto` prefers where. The module sits below the fast paths and above nothing but the options,
formats and statistics, so choosing one never imports another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from .formats import FormatSpec
from .options import Backend, BackendUnavailableError, Rounding, ScalingSpec
from .partial_sums import ErrorStats

# What a quantization returns: (values, statistics or None, scale, amax).
QuantResult = tuple[Tensor, ErrorStats | None, Tensor, Tensor]


@dataclass(frozen=True)
class QuantRequest:
    """One quantization as `api` hands it to a fast path: a non-empty ``x`` and its validated options, the uniform
    draws of stochastic rounding (``noise``), a precomputed per-tensor ``scale``, and an ``out`` for the values."""

    x: Tensor
    fmt: FormatSpec
    spec: ScalingSpec
    rounding: Rounding
    saturate: bool
    noise: Tensor | None
    scale: Tensor | None
    with_stats: bool
    out: Tensor | None


@runtime_checkable
class FastPath(Protocol):
    """One fast path, as a module: its `Backend`, what it cannot run, whether it can run here, and the run itself."""

    NAME: Backend

    def unsupported_reason(
        self, x: Tensor, fmt: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool
    ) -> str | None:
        """Why this path cannot run the quantization whatever ``x``'s values (device, dtype, shape, options), or
        None when it can."""

    def available(self) -> bool:
        """True when the path can run on this machine (building it now where it builds on first use)."""

    def prepare(self) -> None:
        """Build or load what the path needs; `BackendUnavailableError` saying why it cannot be had."""

    def quantize(self, request: QuantRequest) -> QuantResult | None:
        """Run the request: the `QuantResult`, its values in ``out`` where the path writes there (the caller copies
        them otherwise), or None where the path declines ``x`` for its values (another backend then runs it).
        Raises `BackendUnavailableError` when the quantization is unsupported or the path cannot be built."""


def raise_if_unsupported(name: Backend, reason: str | None) -> None:
    """Raise `BackendUnavailableError` naming the backend and ``reason`` (an `unsupported_reason`) unless it is None."""
    if reason is not None:
        raise BackendUnavailableError(f"{name.value} backend does not support {reason}")


def check_supported(
    path: FastPath, x: Tensor, fmt: FormatSpec, spec: ScalingSpec, rounding: Rounding, saturate: bool
) -> None:
    """Raise `BackendUnavailableError` when ``path`` cannot run this quantization here (unsupported, or not built)."""
    raise_if_unsupported(path.NAME, path.unsupported_reason(x, fmt, spec, rounding, saturate))
    path.prepare()
