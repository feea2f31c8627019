"""Number-format facts, with constants named after the specifications that define them.

Sources:

* OCP 8-bit Floating Point Specification (OFP8), rev. 1.0 (2023): E4M3 (finite, one NaN encoding, max 448) and
  E5M2 (IEEE-like, ±inf and NaN, max 57344).
* OCP Microscaling Formats (MX) Specification v1.0 (2023): the element formats FP6 E3M2 / E2M3, FP4 E2M1, the
  shared scale format E8M0 and the MX block of 32 elements (§5, §6.3).
* NVIDIA NVFP4 (Blackwell): FP4 E2M1 elements, blocks of 16 with an E4M3 block scale and an FP32 per-tensor scale.

``FP4_E1M2`` is not an OCP format: it is the "uniform grid, small range" 4-bit float (bias 1, no inf/NaN), whose
positive values are 0, 0.5, …, 3.5 evenly spaced.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Special(enum.Enum):
    """Which special values a format encodes; it decides what overflow and non-finite inputs become."""

    IEEE = "ieee"  # all-ones exponent encodes ±inf and NaN (E5M2)
    FN = "fn"  # finite only; the all-ones exponent *and* mantissa pattern is NaN (E4M3 "fn")
    NONE = "none"  # neither inf nor NaN (FP6, FP4, integers)
    NAN_ONLY = "nan_only"  # unsigned, no zero, one NaN encoding (E8M0)


class Kind(enum.Enum):
    """Whether a format is a minifloat, a symmetric integer or a power-of-two scale."""

    FLOAT = "float"
    INT = "int"
    SCALE = "scale"


@dataclass(frozen=True)
class FormatSpec:
    """The bit facts of one element format.

    ``max_value`` is the largest finite magnitude, ``min_normal`` the smallest normal magnitude, ``min_subnormal`` the
    smallest non-zero magnitude (equal to ``min_normal`` for formats without subnormals) and ``emax`` the exponent of
    the largest power of two not above ``max_value`` (the OCP MX spec's *emax_elem*, used for shared scales).
    Integers are symmetric (``-max_value … max_value``) with ``mantissa_bits = bits - 1`` and no exponent.
    """

    name: str
    kind: Kind
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    special: Special
    max_value: float
    min_normal: float
    min_subnormal: float
    emax: int

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (``1 - bias`` for floats with subnormals)."""
        return round(math.log2(self.min_normal))

    @property
    def has_inf(self) -> bool:
        """True when the format encodes ±infinity."""
        return self.special is Special.IEEE

    @property
    def has_nan(self) -> bool:
        """True when the format encodes NaN."""
        return self.special in (Special.IEEE, Special.FN, Special.NAN_ONLY)

    @property
    def is_signed(self) -> bool:
        """False only for the unsigned scale format E8M0."""
        return self.kind is not Kind.SCALE


def _float_spec(name: str, exponent_bits: int, mantissa_bits: int, special: Special) -> FormatSpec:
    bias = 2 ** (exponent_bits - 1) - 1
    top_exponent_field = 2**exponent_bits - 1
    if special is Special.IEEE:
        # The all-ones exponent is reserved for inf/NaN.
        max_exponent = top_exponent_field - 1 - bias
        max_mantissa = 2**mantissa_bits - 1
    elif special is Special.FN:
        # The all-ones exponent holds normal numbers except the all-ones mantissa, which is NaN.
        max_exponent = top_exponent_field - bias
        max_mantissa = 2**mantissa_bits - 2
    else:
        max_exponent = top_exponent_field - bias
        max_mantissa = 2**mantissa_bits - 1
    max_value = (1 + max_mantissa / 2**mantissa_bits) * 2.0**max_exponent
    min_normal = 2.0 ** (1 - bias)
    min_subnormal = 2.0 ** (1 - bias - mantissa_bits)
    return FormatSpec(
        name=name,
        kind=Kind.FLOAT,
        bits=1 + exponent_bits + mantissa_bits,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        bias=bias,
        special=special,
        max_value=max_value,
        min_normal=min_normal,
        min_subnormal=min_subnormal,
        emax=max_exponent,
    )


def _int_spec(name: str, bits: int) -> FormatSpec:
    max_value = 2 ** (bits - 1) - 1
    return FormatSpec(
        name=name,
        kind=Kind.INT,
        bits=bits,
        exponent_bits=0,
        mantissa_bits=bits - 1,
        bias=0,
        special=Special.NONE,
        max_value=float(max_value),
        min_normal=1.0,
        min_subnormal=1.0,
        emax=math.floor(math.log2(max_value)),
    )


# OCP OFP8 rev 1.0, table 1.
FP8_E4M3 = _float_spec("fp8_e4m3", 4, 3, Special.FN)
FP8_E5M2 = _float_spec("fp8_e5m2", 5, 2, Special.IEEE)
# OCP MX v1.0, §5.3.
FP6_E3M2 = _float_spec("fp6_e3m2", 3, 2, Special.NONE)
FP6_E2M3 = _float_spec("fp6_e2m3", 2, 3, Special.NONE)
FP4_E2M1 = _float_spec("fp4_e2m1", 2, 1, Special.NONE)
FP4_E1M2 = _float_spec("fp4_e1m2", 1, 2, Special.NONE)
INT8 = _int_spec("int8", 8)
INT4 = _int_spec("int4", 4)
# OCP MX v1.0, §5.4.1: E8M0 encodes 2^(E-127) for E in 0..254 and NaN for 255; no sign, no zero.
E8M0_BIAS = 127
E8M0_EXPONENT_MIN = -127
E8M0_EXPONENT_MAX = 127
E8M0 = FormatSpec(
    name="e8m0",
    kind=Kind.SCALE,
    bits=8,
    exponent_bits=8,
    mantissa_bits=0,
    bias=E8M0_BIAS,
    special=Special.NAN_ONLY,
    max_value=2.0**E8M0_EXPONENT_MAX,
    min_normal=2.0**E8M0_EXPONENT_MIN,
    min_subnormal=2.0**E8M0_EXPONENT_MIN,
    emax=E8M0_EXPONENT_MAX,
)

F8E4M3_MAX = FP8_E4M3.max_value  # 448
F8E5M2_MAX = FP8_E5M2.max_value  # 57344
F6E3M2_MAX = FP6_E3M2.max_value  # 28
F6E2M3_MAX = FP6_E2M3.max_value  # 7.5
F4E2M1_MAX = FP4_E2M1.max_value  # 6
F4E1M2_MAX = FP4_E1M2.max_value  # 3.5
# OCP MX v1.0 §5: k = 32 elements share one E8M0 scale.
MX_BLOCK_SIZE = 32
# NVFP4: 16 elements share one E4M3 block scale; the smallest block scale used is E4M3's smallest normal (2^-6),
# as in pytorch/ao's reference (torchao.prototype.mx_formats.nvfp4_tensor, E4M3_EPS).
NVFP4_BLOCK_SIZE = 16
NVFP4_BLOCK_SCALE_MIN = FP8_E4M3.min_normal

FORMATS: dict[str, FormatSpec] = {
    spec.name: spec for spec in (FP8_E4M3, FP8_E5M2, FP6_E3M2, FP6_E2M3, FP4_E2M1, FP4_E1M2, INT8, INT4, E8M0)
}


@dataclass(frozen=True)
class Preset:
    """A named pairing of an element format with the scaling that defines it (``mxfp4`` = ``fp4_e2m1`` + ``block:32``).

    ``mxfp6`` uses ``fp6_e2m3`` (the OCP MX spec defines MXFP6 with either element format; E2M3 keeps more mantissa,
    the usual choice for training); name ``fp6_e3m2`` with ``scaling="block:32"`` for the other one.
    """

    name: str
    element: FormatSpec
    scaling: str


PRESETS: dict[str, Preset] = {
    "mxfp8": Preset("mxfp8", FP8_E4M3, f"block:{MX_BLOCK_SIZE}"),
    "mxfp6": Preset("mxfp6", FP6_E2M3, f"block:{MX_BLOCK_SIZE}"),
    "mxfp4": Preset("mxfp4", FP4_E2M1, f"block:{MX_BLOCK_SIZE}"),
    "nvfp4": Preset("nvfp4", FP4_E2M1, f"nvblock:{NVFP4_BLOCK_SIZE}"),
}


def accepted_format_names() -> list[str]:
    """Every name `quantize` accepts as a format: element formats, then presets."""
    return [*FORMATS, *PRESETS]


def resolve_format(name: str | FormatSpec) -> tuple[FormatSpec, str | None]:
    """Return ``(element format, preset scaling or None)`` for a format or preset name.

    Raises ``ValueError`` listing the accepted names for an unknown name and ``TypeError`` for a non-string.
    """
    if isinstance(name, FormatSpec):
        return name, None
    if not isinstance(name, str):
        raise TypeError(f"fmt must be a format name (str) or FormatSpec, got {type(name).__name__}")
    key = name.strip().lower()
    if key in FORMATS:
        return FORMATS[key], None
    if key in PRESETS:
        preset = PRESETS[key]
        return preset.element, preset.scaling
    raise ValueError(f"fmt: unknown format {name!r}; accepted: {', '.join(accepted_format_names())}")
