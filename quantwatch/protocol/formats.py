"""Names of the number formats and scalings, and the per-layer format a batch may carry (``layer_formats``).

The collector validates and matches these names without importing :mod:`quantwatch.kernels` (whose ``__init__``
imports torch); the kernels' own tables must agree with them, which a test checks.

A layer's format is one string per tensor kind, ``ELEMENT[:SCALING]``: ``"fp8_e4m3:tensor"``, ``"fp8_e4m3:row"``,
``"nvfp4"`` (a preset carries its own scaling), ``"int4:group32"``, or ``"high_precision"`` for a tensor the layer
keeps unquantized.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "ELEMENT_FORMATS",
    "HIGH_PRECISION",
    "MAX_CANDIDATE_LENGTH",
    "MAX_FORMAT_LENGTH",
    "OWN_BLOCK",
    "PRESETS",
    "SCALING_KINDS",
    "STOCHASTIC_SUFFIX",
    "TENSOR_KINDS",
    "WHATIF_CANDIDATES",
    "candidate_bits",
    "candidate_spec",
    "check_candidate",
    "check_layer_format",
    "format_bits",
    "own_candidates",
]

ELEMENT_FORMATS: Mapping[str, int] = {
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "fp6_e3m2": 6,
    "fp6_e2m3": 6,
    "fp4_e2m1": 4,
    "fp4_e1m2": 4,
    "int8": 8,
    "int4": 4,
    "e8m0": 8,
    "uint8": 8,
    "uint4": 4,
    "bf16": 16,
    "fp16": 16,
    "fp32": 32,
}
"""Element formats and their bits per element (the 16- and 32-bit floats name what a layer keeps in higher
precision when an adapter says which)."""

PRESETS: Mapping[str, int] = {"mxfp8": 8, "mxfp6": 6, "mxfp4": 4, "nvfp4": 4}
"""Formats that name their element format and block scaling together, and their bits per element."""

HIGH_PRECISION = "high_precision"
"""A tensor kind the layer keeps unquantized (e.g. the weight-gradient GEMM of torchao's ``rowwise_with_gw_hp``)."""

SCALING_KINDS: tuple[str, ...] = ("none", "tensor", "row", "token", "channel", "group", "block", "nvblock", "delayed")
"""The scaling granularities a format string may name after its colon (with parameters: ``block:32``); ``token`` is
one scale per token of an activation (torchao QAT's ``per_token``)."""

TENSOR_KINDS: tuple[str, ...] = ("weight", "input", "grad")
"""The tensor kinds a layer quantizes, the keys of one entry of ``layer_formats``."""

_FORMAT_RE = re.compile(r"^(?P<element>[a-z0-9_]+)(?::(?P<scaling>[a-z]+)(?P<params>[0-9a-z:._-]*))?$")
MAX_FORMAT_LENGTH = 64


def check_layer_format(value: str) -> str:
    """``value`` if it is a valid format string, else ``ValueError`` saying what is wrong."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_FORMAT_LENGTH:
        raise ValueError(f"must be a format string of 1..{MAX_FORMAT_LENGTH} characters")
    if value == HIGH_PRECISION:
        return value
    match = _FORMAT_RE.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not ELEMENT[:SCALING]")
    element, scaling = match["element"], match["scaling"]
    if element not in ELEMENT_FORMATS and element not in PRESETS:
        known = ", ".join([*ELEMENT_FORMATS, *PRESETS, HIGH_PRECISION])
        raise ValueError(f"unknown format {element!r}; known: {known}")
    if scaling is not None and scaling not in SCALING_KINDS:
        raise ValueError(f"unknown scaling {scaling!r}; known: {', '.join(SCALING_KINDS)}")
    return value


def format_bits(value: str) -> int | None:
    """Bits per element of a format string (None for ``high_precision``)."""
    element = value.split(":", 1)[0]
    return ELEMENT_FORMATS.get(element) or PRESETS.get(element)


WHATIF_CANDIDATES: tuple[str, ...] = ("fp8_e4m3:tensor", "mxfp8", "nvfp4", "mxfp4")
"""The candidates every layer's what-if statistics try by default; each layer adds its own format per tensor kind,
that format with block scaling and, for gradients, that with stochastic rounding (see :func:`candidate_spec`)."""

STOCHASTIC_SUFFIX = "+sr"
"""Appended to a candidate's format string for stochastic rounding (``"fp4_e2m1:block32+sr"``)."""

OWN_BLOCK = 32
"""The block size of a layer's own format with block scaling (E8M0 scales, as OCP MX)."""

MAX_CANDIDATE_LENGTH = MAX_FORMAT_LENGTH + len(STOCHASTIC_SUFFIX)

_SCALING_PARAMS = re.compile(r"^(?P<kind>[a-z]+)(?P<size>[0-9]*)$")


def check_candidate(value: object) -> str:
    """``value`` if it names a what-if candidate (a format string, optionally with :data:`STOCHASTIC_SUFFIX`), else
    ``ValueError``."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CANDIDATE_LENGTH:
        raise ValueError(f"must be a candidate name of 1..{MAX_CANDIDATE_LENGTH} characters")
    base = value.removesuffix(STOCHASTIC_SUFFIX)
    if base == HIGH_PRECISION:
        raise ValueError("high_precision is not a candidate format")
    check_layer_format(base)
    return value


def candidate_spec(candidate: str) -> tuple[str, str | None, str]:
    """``(fmt, scaling, rounding)`` as ``quantwatch.kernels.quantize`` and ``QuantSpec`` take them for a candidate
    (``scaling`` None for a preset); ``ValueError`` for a scaling they do not have (``group``, ``row``)."""
    check_candidate(candidate)
    rounding = "stochastic" if candidate.endswith(STOCHASTIC_SUFFIX) else "nearest"
    element, _, scaling = candidate.removesuffix(STOCHASTIC_SUFFIX).partition(":")
    if element in PRESETS:
        return element, None, rounding
    match = _SCALING_PARAMS.fullmatch(scaling or "none")
    if match is None or match["kind"] not in ("none", "tensor", "block", "nvblock", "channel"):
        raise ValueError(f"{candidate!r}: scaling {scaling!r} has no quantizer")
    kind, size = match["kind"], match["size"]
    return element, f"{kind}:{size}" if size else kind, rounding


def own_candidates(kind: str, own: str) -> tuple[str, ...]:
    """The candidates a layer of format ``own`` adds for tensor ``kind``: ``own`` itself, ``own`` with blocks of
    :data:`OWN_BLOCK` (a preset: as it is) and, for ``grad``, that with stochastic rounding; named as presets where
    they are one (``fp8_e4m3:block32`` is ``mxfp8``)."""
    if own == HIGH_PRECISION:
        return ()
    element = own.split(":", 1)[0]
    block = element if element in PRESETS else _preset_name(f"{element}:block{OWN_BLOCK}")
    names = [own, block] + ([block + STOCHASTIC_SUFFIX] if kind == "grad" else [])
    return tuple(dict.fromkeys(names))


_PRESET_FORMATS = {"fp8_e4m3:block32": "mxfp8", "fp6_e2m3:block32": "mxfp6", "fp4_e2m1:block32": "mxfp4"}


def _preset_name(value: str) -> str:
    return _PRESET_FORMATS.get(value, value)


def candidate_bits(candidate: str) -> int | None:
    """Bits per element of a candidate (rounding does not change them)."""
    return format_bits(candidate.removesuffix(STOCHASTIC_SUFFIX))
