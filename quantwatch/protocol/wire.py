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
from quantwatch.protocol.formats import MAX_CANDIDATE_LENGTH, MAX_FORMAT_LENGTH, TENSOR_KINDS

__all__ = [
    "ACTIONS_FIELD",
    "ACTION_KEYS",
    "ACTION_KINDS",
    "CONTENT_TYPES",
    "ENVIRONMENT_FIELD",
    "ENVIRONMENT_KEYS",
    "ESTIMATED_FIELD",
    "FINGERPRINT_FIELD",
    "FINGERPRINT_HASH_RULE",
    "FIRING_EPISODES_FIELD",
    "FIRING_EPISODE_KEYS",
    "INGEST_PATH",
    "LAYER_FORMATS_FIELD",
    "MAX_ACTIONS",
    "MAX_ACTION_DETAIL_LENGTH",
    "MAX_BATCH_ID_LENGTH",
    "MAX_ENVIRONMENT_VALUE_LENGTH",
    "MAX_LAYER_NAME_LENGTH",
    "MAX_RANK",
    "MAX_REPLICA_GROUP",
    "MAX_STEP",
    "NONFINITE_TOKENS",
    "PROTOCOL_VERSION",
    "RUN_NAME_PATTERN",
    "RUN_NAME_RULE",
    "SERIES_NAME_PATTERN",
    "WHATIF_FIELD",
    "WHATIF_STATS",
    "Action",
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
    for a layer of unknown format; ``None`` as a whole for a batch without formats (older agents). ``actions``: what
    the agent did to the training job since its previous batch (:class:`Action`).
    """

    run: str
    rank: int
    batch_id: str
    layers: tuple[str, ...]
    steps: tuple[StepT, ...]
    layer_formats: tuple[Mapping[str, str] | None, ...] | None = None
    actions: tuple[Action, ...] = ()


@dataclass(frozen=True)
class Action:
    """One action the agent took on the training job (protocol :data:`ACTIONS_FIELD`, keys :data:`ACTION_KEYS`)."""

    step: int
    action: str
    layer: str = ""
    detail: str = ""
    episode: int | None = None

    def wire(self) -> dict[str, Any]:
        """The wire map."""
        return {key: getattr(self, key) for key in ACTION_KEYS}


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

FINGERPRINT_FIELD = "fingerprints"
"""A step's fingerprints of the rank's master weights, for the cross-rank comparison (``rank_weight_mismatch``):
``{"group": [ranks of the replica group], "sum": [Σw], "sumsq": [Σw²], "hash": [hex of the bits' checksum]}``, each
array aligned with the batch's ``layers`` (``null`` for a layer without a weight; sums are float64, never float32
``bin``). Sent on sampled steps by every rank of a replica group of more than one, reporting or not."""

FINGERPRINT_HASH_RULE = "[0-9a-f]{1,64}"
MAX_REPLICA_GROUP = 65536
"""Ranks in one replica group at most."""

ENVIRONMENT_FIELD = "environment"
"""A step's ``{"torch": "2.13.0", ...}``: the rank's software and device, sent with the first step it reports."""

ENVIRONMENT_KEYS = ("torch", "cuda", "nccl", "driver", "device", "compute_capability", "quantwatch")
"""The environment facts an agent reports (others are kept too, as sent); ``""`` where one does not apply."""

MAX_ENVIRONMENT_VALUE_LENGTH = 200

NONFINITE_TOKENS: dict[str, float] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
"""How JSON carries non-finite values (signals, not errors)."""

CONTENT_TYPES: dict[str, str] = {"msgpack": "application/msgpack", "json": "application/json"}

LAYER_FORMATS_FIELD = "layer_formats"
"""The optional batch field aligned with ``layers``: per layer ``null`` or ``{kind: format}`` for some of
:data:`~quantwatch.protocol.formats.TENSOR_KINDS` (formats as :func:`~quantwatch.protocol.formats.check_layer_format`
accepts them). Batches without it (older agents) carry no format."""


ESTIMATED_FIELD = "estimated"
"""The optional step field naming the metrics of the step that some layer estimated from a subset of rows (the agent's
``shadow_rows``) rather than computed exactly: distinct names, each one of the step's ``metrics``. Absent: all exact."""


FIRING_EPISODES_FIELD = "firing_episodes"
"""The field of the ingest answer listing the run's alert episodes firing once the batch is stored (each a map of
:data:`FIRING_EPISODE_KEYS`), so the agent learns them with no request of its own; absent when none fires (the
answer of a quiet run is as it always was)."""

FIRING_EPISODE_KEYS = ("episode", "rule", "layer", "ranks", "since_step", "severity")
"""One firing episode in the ingest answer: its id, the rule's name, the layer (``""`` for a run-level rule), the
ranks it fires on, the step it started firing at, and the rule's severity."""

ACTIONS_FIELD = "actions"
"""The optional batch field of the actions the agent took on the training job (``quantwatch.agent.actions``): each a
map of :data:`ACTION_KEYS`; stored on the run and listed by ``GET /api/v1/actions?run=``."""

ACTION_KINDS = ("keep_high_precision", "save_shadow_checkpoint", "stop_training")
"""What an action can be."""

ACTION_KEYS = ("step", "action", "layer", "detail", "episode")
"""One action: the step it was taken after (in effect from the next one), its kind (:data:`ACTION_KINDS`), the
layer it changed (``""`` for the whole run), what changed in words (``"weight fp4_e2m1:tensor → fp8_e4m3:tensor"``),
and the alert episode that asked for it (``null``: none)."""

MAX_ACTIONS = 1024
MAX_ACTION_DETAIL_LENGTH = 2000
WHATIF_FIELD = "whatif"
"""The optional step field of what-if statistics: ``{kind: {candidate: {stat: [values aligned with layers]}}}``
with ``kind`` one of :data:`~quantwatch.protocol.formats.TENSOR_KINDS`, ``candidate`` a name
:func:`~quantwatch.protocol.formats.check_candidate` accepts and ``stat`` one of :data:`WHATIF_STATS`; values as
metric values (``null``: the layer did not try that candidate; msgpack may send a float32 ``bin``). Sent on the
agent's what-if steps only (``attach(whatif_every=...)``); older agents never send it."""

WHATIF_STATS: tuple[str, ...] = ("rel_l2", "underflow_ratio", "overflow_ratio")
"""What a what-if entry says about a tensor quantized to a candidate (``ErrorStats``' figures of those names)."""


ENVIRONMENT_FIELD_DOC = "the rank's software and device (torch, CUDA, NCCL, driver, device, quantwatch versions)"


def _fingerprint_schema(value: dict[str, Any]) -> dict[str, Any]:
    nullable_hash = {"anyOf": [{"type": "string", "pattern": f"^{FINGERPRINT_HASH_RULE}$"}, {"type": "null"}]}
    return {
        "type": "object",
        "description": "fingerprints of the rank's master weights per layer, for the cross-rank comparison",
        "required": ["group", "sum", "sumsq", "hash"],
        "properties": {
            "group": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_REPLICA_GROUP,
                "items": {"type": "integer", "minimum": 0, "maximum": MAX_RANK},
            },
            "sum": {"type": "array", "items": value},
            "sumsq": {"type": "array", "items": value},
            "hash": {"type": "array", "items": nullable_hash},
        },
    }


def _whatif_schema(values: dict[str, Any]) -> dict[str, Any]:
    per_candidate = {"type": "object", "properties": dict.fromkeys(WHATIF_STATS, values), "additionalProperties": False}
    per_kind = {
        "type": "object",
        "propertyNames": {"minLength": 1, "maxLength": MAX_CANDIDATE_LENGTH},
        "additionalProperties": per_candidate,
    }
    return {
        "type": "object",
        "description": "What-if statistics: each tensor kind's error under candidate formats, aligned with `layers`.",
        "properties": dict.fromkeys(TENSOR_KINDS, per_kind),
        "additionalProperties": False,
    }


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
            ACTIONS_FIELD: {
                "type": "array",
                "description": "Actions the agent took on the training job (quantwatch.agent.actions).",
                "maxItems": MAX_ACTIONS,
                "items": {
                    "type": "object",
                    "required": ["step", "action"],
                    "properties": {
                        "step": {"type": "integer", "minimum": 0, "maximum": MAX_STEP},
                        "action": {"enum": list(ACTION_KINDS)},
                        "layer": {"type": "string", "maxLength": MAX_LAYER_NAME_LENGTH, "default": ""},
                        "detail": {"type": "string", "maxLength": MAX_ACTION_DETAIL_LENGTH, "default": ""},
                        "episode": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": None},
                    },
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
                        FINGERPRINT_FIELD: _fingerprint_schema(value),
                        ENVIRONMENT_FIELD: {
                            "type": "object",
                            "description": ENVIRONMENT_FIELD_DOC,
                            "properties": {key: {"type": "string"} for key in ENVIRONMENT_KEYS},
                            "additionalProperties": {"type": "string", "maxLength": MAX_ENVIRONMENT_VALUE_LENGTH},
                        },
                        WHATIF_FIELD: _whatif_schema(values),
                        ESTIMATED_FIELD: {
                            "type": "array",
                            "description": "Metrics of this step estimated from a subset of rows (each in `metrics`).",
                            "items": {"type": "string", "pattern": f"^{SERIES_NAME_RULE}$"},
                            "uniqueItems": True,
                        },
                    },
                },
            },
        },
    }
