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
    "MAX_FORMAT_LENGTH",
    "PRESETS",
    "SCALING_KINDS",
    "TENSOR_KINDS",
    "check_layer_format",
    "format_bits",
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
