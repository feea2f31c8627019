"""The knobs of a quantization, named by strings or enums: scaling, rounding and backend."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

from .formats import MX_BLOCK_SIZE, NVFP4_BLOCK_SIZE

DEFAULT_DELAYED_HISTORY = 16


class Scaling(enum.Enum):
    """How a tensor is scaled into a format's range before the cast.

    ``NONE`` plain cast; ``TENSOR`` one FP32 scale ``amax / max`` (``"tensor:pow2"`` rounds it up to a power of two);
    ``CHANNEL`` one scale per index of an axis (``"channel:AXIS"``, default axis 0); ``BLOCK`` blocks of N along the
    last dimension sharing an E8M0 scale (OCP MX); ``NVBLOCK`` blocks of N with E4M3 block scales under an FP32
    per-tensor scale (NVFP4); ``DELAYED`` a per-tensor scale from an amax history of N steps (TransformerEngine
    DelayedScaling), ``"delayed:N"`` or ``"delayed:N:MARGIN"``.
    """

    NONE = "none"
    TENSOR = "tensor"
    CHANNEL = "channel"
    BLOCK = "block"
    NVBLOCK = "nvblock"
    DELAYED = "delayed"


class Rounding(enum.Enum):
    """Round to nearest, ties to even (default), or stochastic rounding (unbiased, seeded ``torch.Generator``)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


class Backend(enum.Enum):
    """Which implementation runs a quantization.

    ``AUTO`` picks Triton for CUDA tensors when Triton is installed; for large CPU tensors the native kernels where
    they apply (float32, round to nearest, float formats: see `quantwatch.kernels.native`), else the
    ``torch.compile`` fused path; and the plain-torch reference otherwise, falling back to the next when a fast path
    fails to build. ``REFERENCE`` is the source of truth; ``NATIVE``, ``COMPILED`` and ``TRITON`` raise
    `BackendUnavailableError` when they cannot run (``NATIVE`` hands tensors holding NaN/±inf to the compiled path).
    """

    AUTO = "auto"
    REFERENCE = "reference"
    COMPILED = "compiled"
    NATIVE = "native"
    TRITON = "triton"


SCALING_SYNTAX = ("none", "tensor", "tensor:pow2", "channel", "channel:AXIS", "block:N", "nvblock:N", "delayed:N")


@dataclass(frozen=True)
class ScalingSpec:
    """A parsed scaling: its kind and parameters (``axis`` for channel, ``block_size``, ``history`` and ``margin``)."""

    kind: Scaling
    axis: int = 0
    block_size: int = 0
    history: int = 0
    margin: int = 0
    pow2: bool = False

    def __str__(self) -> str:
        if self.kind is Scaling.TENSOR:
            return "tensor:pow2" if self.pow2 else "tensor"
        if self.kind is Scaling.CHANNEL:
            return f"channel:{self.axis}"
        if self.kind in (Scaling.BLOCK, Scaling.NVBLOCK):
            return f"{self.kind.value}:{self.block_size}"
        if self.kind is Scaling.DELAYED:
            return f"delayed:{self.history}:{self.margin}" if self.margin else f"delayed:{self.history}"
        return str(self.kind.value)


def _bad_scaling(text: object, why: str) -> ValueError:
    return ValueError(f"scaling: {why} in {text!r}; accepted: {', '.join(SCALING_SYNTAX)}")


def _int_param(text: str, part: str, what: str, minimum: int) -> int:
    try:
        value = int(part)
    except ValueError:
        raise _bad_scaling(text, f"{what} must be an integer") from None
    if value < minimum:
        raise _bad_scaling(text, f"{what} must be ≥ {minimum}")
    return value


def parse_scaling(scaling: str | Scaling | ScalingSpec) -> ScalingSpec:
    """Parse a scaling name (``"block:32"``), a `Scaling` member (default parameters) or pass a `ScalingSpec` through.

    Raises ``ValueError`` listing the accepted syntax for anything else.
    """
    if isinstance(scaling, ScalingSpec):
        return scaling
    if isinstance(scaling, Scaling):
        scaling = scaling.value
    if not isinstance(scaling, str):
        raise TypeError(f"scaling must be a str, Scaling or ScalingSpec, got {type(scaling).__name__}")
    text = scaling.strip().lower()
    head, _, rest = text.partition(":")
    params = rest.split(":") if rest else []
    if head == "none" and not params:
        return ScalingSpec(Scaling.NONE)
    if head == "tensor" and params in ([], ["pow2"]):
        return ScalingSpec(Scaling.TENSOR, pow2=bool(params))
    if head == "channel" and len(params) <= 1:
        axis = int(params[0]) if params and params[0].lstrip("-").isdigit() else None
        if params and axis is None:
            raise _bad_scaling(scaling, "channel axis must be an integer")
        return ScalingSpec(Scaling.CHANNEL, axis=axis or 0)
    if head in ("block", "nvblock") and len(params) <= 1:
        default = MX_BLOCK_SIZE if head == "block" else NVFP4_BLOCK_SIZE
        size = _int_param(scaling, params[0], "block size", 1) if params else default
        return ScalingSpec(Scaling(head), block_size=size)
    if head == "delayed" and len(params) <= 2:
        history = _int_param(scaling, params[0], "history length", 1) if params else DEFAULT_DELAYED_HISTORY
        margin = _int_param(scaling, params[1], "margin", 0) if len(params) == 2 else 0
        return ScalingSpec(Scaling.DELAYED, history=history, margin=margin)
    raise _bad_scaling(scaling, "unknown scaling")


_Choice = TypeVar("_Choice", bound=enum.Enum)


def _parse_choice(field: str, kind: type[_Choice], value: str | _Choice) -> _Choice:
    """``value`` as a member of ``kind`` (by its value, case and surrounding space ignored); ``ValueError`` naming
    ``field`` and listing the accepted values otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(str(value).strip().lower())
    except ValueError:
        accepted = ", ".join(member.value for member in kind)
        raise ValueError(f"{field}: unknown {field} {value!r}; accepted: {accepted}") from None


def parse_rounding(rounding: str | Rounding) -> Rounding:
    """Parse ``"nearest"`` / ``"stochastic"``; ``ValueError`` listing them otherwise."""
    return _parse_choice("rounding", Rounding, rounding)


def parse_backend(backend: str | Backend) -> Backend:
    """Parse a backend name; ``ValueError`` listing ``auto, reference, compiled, native, triton`` otherwise."""
    return _parse_choice("backend", Backend, backend)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (not installed, wrong device, or an unsupported option)."""
