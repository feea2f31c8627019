"""Names of the exported families and the text format's spelling of labels and values.

The bottom layer of the exposition: family names come from the protocol's catalogue (``quantwatch.protocol``), custom
names are made safe; the label escaping and row prefixes are memoised because the same names come back every scrape.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import cast

from prometheus_client.utils import floatToGoString

from quantwatch.protocol import CATALOG

__all__ = [
    "LAYER_METRIC_FAMILIES",
    "RUN_SCALAR_FAMILIES",
    "escape_label_value",
    "go_float",
    "layer_family_name",
    "row_prefix",
    "run_family_name",
]

# The text format's spelling of a float (+Inf, NaN, Go-style exponents); prometheus_client leaves it untyped.
go_float = cast("Callable[[float], str]", floatToGoString)


# Canonical metric → exported gauge family, from the protocol's catalogue.
LAYER_METRIC_FAMILIES: Mapping[str, str] = {m.name: m.family for m in CATALOG.values() if m.scope == "layer"}

RUN_SCALAR_FAMILIES: Mapping[str, str] = {m.name: m.family for m in CATALOG.values() if m.scope == "run"}

# A custom name that spells a canonical family (or one of the collector's own) must not merge into it.
_CANONICAL_FAMILIES = frozenset(
    [
        *LAYER_METRIC_FAMILIES.values(),
        *RUN_SCALAR_FAMILIES.values(),
        "quantwatch_run_last_step",
        "quantwatch_run_last_ingest_timestamp_seconds",
    ]
)
_RESERVED_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created", "_info")
_NOT_NAME_CHARS = re.compile(r"[^a-z0-9_]")


def _family_name(canonical: Mapping[str, str], prefix: str, name: str) -> str:
    """The family of ``name``: its canonical one, else ``prefix`` + its snake case (no reserved suffix), marked
    ``_custom`` where that would collide with a canonical family."""
    known = canonical.get(name)
    if known is not None:
        return known
    cleaned = _NOT_NAME_CHARS.sub("_", name.lower()).strip("_") or "unnamed"
    if cleaned.endswith(_RESERVED_SUFFIXES):
        cleaned += "_value"
    family = prefix + cleaned
    return family + "_custom" if family in _CANONICAL_FAMILIES else family


def layer_family_name(metric: str) -> str:
    """The exported gauge family of a per-layer metric: ``output_rel_l2`` → ``quantwatch_layer_output_rel_l2_ratio``."""
    return _family_name(LAYER_METRIC_FAMILIES, "quantwatch_layer_", metric)


def run_family_name(scalar: str) -> str:
    """The exported gauge family of a per-run scalar, e.g. ``loss`` → ``quantwatch_run_loss``."""
    return _family_name(RUN_SCALAR_FAMILIES, "quantwatch_run_", scalar)


@functools.lru_cache(maxsize=1 << 16)
def escape_label_value(value: str) -> str:
    # The text format's escaping, byte for byte what prometheus_client writes. Memoised: the same run, layer and rule
    # names come back in every scrape.
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@functools.lru_cache(maxsize=1 << 16)
def row_prefix(family: str, names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """``family{name="value",…} `` with the label names sorted, as the text format writes them. Memoised: the same
    run, rank, rule and layer rows come back in every scrape."""
    labels = ",".join(
        f'{name}="{escape_label_value(value)}"' for name, value in sorted(zip(names, values, strict=True))
    )
    return f"{family}{{{labels}}} "
