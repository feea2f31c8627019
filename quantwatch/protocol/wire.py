"""The wire contract of ``POST /api/v1/ingest`` (ARCHITECTURE.md, wire format): names, limits and the JSON schema.

The agent's encoder and the collector's decoder both read these; the schema the ingest route documents in OpenAPI is
generated from them by :func:`ingest_json_schema`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from quantwatch.protocol.catalog import CATALOG
from quantwatch.protocol.formats import MAX_FORMAT_LENGTH, TENSOR_KINDS

__all__ = [
    "CONTENT_TYPES",
    "INGEST_PATH",
    "LAYER_FORMATS_FIELD",
    "MAX_BATCH_ID_LENGTH",
    "MAX_LAYER_NAME_LENGTH",
    "MAX_RANK",
    "MAX_STEP",
    "NONFINITE_TOKENS",
    "PROTOCOL_VERSION",
    "RUN_NAME_PATTERN",
    "RUN_NAME_RULE",
    "SERIES_NAME_PATTERN",
    "BatchFields",
    "ingest_json_schema",
]

PROTOCOL_VERSION = 1
"""The version of the batch structure an agent sends (``"protocol"``); a batch without one is version 0 (older
agents), which the collector keeps accepting."""

INGEST_PATH = "/api/v1/ingest"

StepT = TypeVar("StepT")


@dataclass(frozen=True)
class BatchFields(Generic[StepT]):
    """The fields of one ingest batch, in wire order; the agent's ``Batch`` and the collector's ``IngestBatch`` add
    their own step type and behaviour.

    ``layer_formats`` is aligned with ``layers`` when the agent sends it: each layer's ``{kind: format}``, or ``None``
    for a layer of unknown format; ``None`` as a whole for a batch without formats (older agents).
    """

    run: str
    rank: int
    batch_id: str
    layers: tuple[str, ...]
    steps: tuple[StepT, ...]
    layer_formats: tuple[Mapping[str, str] | None, ...] | None = None


RUN_NAME_RULE = "[A-Za-z0-9._:/-]{1,200}"
RUN_NAME_PATTERN = re.compile(RUN_NAME_RULE)
"""A run name (ARCHITECTURE.md vocabulary)."""

SERIES_NAME_RULE = "[A-Za-z0-9_.:-]{1,200}"
SERIES_NAME_PATTERN = re.compile(SERIES_NAME_RULE)
"""A metric or scalar name on the wire (custom names included)."""

MAX_LAYER_NAME_LENGTH = 500
MAX_BATCH_ID_LENGTH = 128
MAX_STEP = 2**62
MAX_RANK = 2**31 - 1

NONFINITE_TOKENS: dict[str, float] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
"""How JSON carries non-finite values (signals, not errors)."""

CONTENT_TYPES: dict[str, str] = {"msgpack": "application/msgpack", "json": "application/json"}

LAYER_FORMATS_FIELD = "layer_formats"
"""The optional batch field aligned with ``layers``: per layer ``null`` or ``{kind: format}`` for some of
:data:`~quantwatch.protocol.formats.TENSOR_KINDS` (formats as :func:`~quantwatch.protocol.formats.check_layer_format`
accepts them). Batches without it (older agents) carry no format."""


def ingest_json_schema() -> dict[str, Any]:
    """The JSON schema of one ingest batch (the JSON encoding; msgpack has the same structure with float32 ``bin``
    metric arrays)."""
    value: dict[str, Any] = {"anyOf": [{"type": "number"}, {"type": "null"}, {"enum": list(NONFINITE_TOKENS)}]}
    values: dict[str, Any] = {"type": "array", "items": value}
    # Catalogued names are documented one by one; any other valid name is a custom series, stored as sent.
    metrics = {m.name: values | {"description": m.meaning} for m in CATALOG.values() if m.scope == "layer"}
    scalars = {m.name: value | {"description": m.meaning} for m in CATALOG.values() if m.scope == "run"}
    return {
        "type": "object",
        "required": ["run", "batch_id", "steps"],
        "properties": {
            "protocol": {"type": "integer", "minimum": 0, "default": 0},
            "run": {"type": "string", "pattern": f"^{RUN_NAME_RULE}$"},
            "rank": {"type": "integer", "minimum": 0, "maximum": MAX_RANK, "default": 0},
            "batch_id": {"type": "string", "minLength": 1, "maxLength": MAX_BATCH_ID_LENGTH},
            "layers": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": MAX_LAYER_NAME_LENGTH},
            },
            LAYER_FORMATS_FIELD: {
                "type": "array",
                "description": "Aligned with `layers`: each layer's number format per tensor kind, or null (unknown).",
                "items": {
                    "anyOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "properties": {
                                kind: {"type": "string", "minLength": 1, "maxLength": MAX_FORMAT_LENGTH}
                                for kind in TENSOR_KINDS
                            },
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "steps": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["step"],
                    "properties": {
                        "step": {"type": "integer", "minimum": 0, "maximum": MAX_STEP},
                        "time": {"type": ["number", "null"]},
                        "metrics": {"type": "object", "properties": metrics, "additionalProperties": values},
                        "scalars": {"type": "object", "properties": scalars, "additionalProperties": value},
                    },
                },
            },
        },
    }
