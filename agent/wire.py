"""The agent → collector wire format (``POST /api/v1/ingest``), see ARCHITECTURE.md.

One :class:`Batch` holds consecutive steps of one (run, rank) that share a layer list.  Two encodings of the same map:

* JSON (``application/json``): metric values are numbers, ``null`` (not measured) or the strings ``"nan"``,
  ``"inf"``, ``"-inf"``;
* msgpack (``application/msgpack``): a metric whose every layer has a value is a ``bin`` of little-endian float32,
  exactly ``4 * len(layers)`` bytes (non-finite values are plain IEEE NaN/±inf in it); otherwise an array of floats and
  nils.  Scalars are msgpack floats.

Either may be gzip-compressed (``Content-Encoding: gzip``).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np

from quantwatch.protocol import (
    ACTIONS_FIELD,
    CONTENT_TYPES,
    ENVIRONMENT_FIELD,
    ESTIMATED_FIELD,
    FINGERPRINT_FIELD,
    LAYER_FORMATS_FIELD,
    PROTOCOL_VERSION,
    WHATIF_FIELD,
    BatchFields,
    check_layer_format,
)

logger = logging.getLogger("quantwatch.agent")

__all__ = [
    "Batch",
    "EncodedBatch",
    "Encoding",
    "Fingerprints",
    "StepRecord",
    "encode_batch",
    "to_wire_dict",
]

Encoding = Literal["msgpack", "json"]

_GZIP_LEVEL = 5


@dataclass(frozen=True)
class Fingerprints:
    """One step's fingerprints of the rank's master weights, aligned with the batch's layers (``None``: no weight),
    and the replica group that must agree on them (protocol ``FINGERPRINT_FIELD``)."""

    group: tuple[int, ...]
    sum: tuple[float | None, ...]
    sumsq: tuple[float | None, ...]
    hash: tuple[str | None, ...]

    def wire(self, encoding: Encoding) -> dict[str, Any]:
        """The wire map (float64 sums; JSON spells non-finite ones as tokens)."""
        number = _json_number if encoding == "json" else _float_or_none
        return {
            "group": list(self.group),
            "sum": [number(v) for v in self.sum],
            "sumsq": [number(v) for v in self.sumsq],
            "hash": list(self.hash),
        }


@dataclass(frozen=True)
class StepRecord:
    """The figures of one step: per-layer ``metrics`` (aligned with the batch's layers, ``None`` = not measured)
    and run-level ``scalars``.  ``estimated`` names the metrics some layer of this step estimated from a subset of
    rows (``attach(shadow_rows=...)``) rather than computed exactly (sent as the step's ``estimated`` when any);
    ``fingerprints`` of the master weights and the rank's ``environment`` when sent; ``whatif`` the what-if
    statistics of a what-if step (``{kind: {candidate: {stat: values}}}``, :mod:`quantwatch.agent.whatif`)."""

    step: int
    time: float
    metrics: Mapping[str, Sequence[float | None]] = field(default_factory=dict)
    scalars: Mapping[str, float] = field(default_factory=dict)
    estimated: frozenset[str] = frozenset()
    fingerprints: Fingerprints | None = None
    environment: Mapping[str, str] | None = None
    whatif: Mapping[str, Mapping[str, Mapping[str, Sequence[float | None]]]] | None = None

    def empty(self) -> bool:
        """Nothing but the step: no metric, scalar, fingerprint or environment."""
        return not (self.metrics or self.scalars or self.fingerprints is not None or self.environment is not None)

    def point_count(self) -> int:
        """Number of stored points this step yields: measured metric values plus scalars."""
        measured = sum(1 for values in self.metrics.values() for v in values if v is not None)
        return measured + len(self.scalars)


@dataclass(frozen=True)
class Batch(BatchFields[StepRecord]):
    """What one ingest request carries; ``batch_id`` makes a retried request idempotent."""

    def point_count(self) -> int:
        """Number of stored points the batch yields."""
        return sum(s.point_count() for s in self.steps)


@dataclass(frozen=True)
class EncodedBatch:
    """A batch ready to send: the request body and the headers that describe it."""

    batch_id: str
    body: bytes
    content_type: str
    gzip: bool
    points: int

    def headers(self) -> dict[str, str]:
        """The ``Content-Type`` (and ``Content-Encoding``) headers of the body."""
        headers = {"Content-Type": self.content_type}
        if self.gzip:
            headers["Content-Encoding"] = "gzip"
        return headers


def _json_number(value: float | None) -> float | str | None:
    if value is None:
        return None
    v = float(value)
    if math.isfinite(v):
        return v
    if math.isnan(v):
        return "nan"
    return "inf" if v > 0 else "-inf"


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)


def _json_metric(values: Sequence[float | None]) -> list[float | str | None]:
    return [_json_number(v) for v in values]


def _msgpack_metric(values: Sequence[float | None]) -> bytes | list[float | None]:
    if any(v is None for v in values):
        return [None if v is None else float(v) for v in values]
    return np.asarray(values, dtype="<f4").tobytes()


def to_wire_dict(batch: Batch, encoding: Encoding) -> dict[str, Any]:
    """The batch as the plain map of the wire format, with metric values shaped for ``encoding``."""
    steps: list[dict[str, Any]] = []
    for record in batch.steps:
        if encoding == "json":
            metrics: dict[str, Any] = {k: _json_metric(vs) for k, vs in record.metrics.items()}
            scalars: dict[str, Any] = {k: _json_number(v) for k, v in record.scalars.items()}
        else:
            metrics = {k: _msgpack_metric(vs) for k, vs in record.metrics.items()}
            scalars = {k: float(v) for k, v in record.scalars.items()}
        step: dict[str, Any] = {"step": record.step, "time": record.time, "metrics": metrics, "scalars": scalars}
        if record.fingerprints is not None:
            step[FINGERPRINT_FIELD] = record.fingerprints.wire(encoding)
        if record.environment is not None:
            step[ENVIRONMENT_FIELD] = dict(record.environment)
        if record.estimated:
            step[ESTIMATED_FIELD] = sorted(record.estimated)
        if record.whatif:
            encode = _msgpack_metric if encoding == "msgpack" else _json_metric
            step[WHATIF_FIELD] = {
                kind: {name: {stat: encode(vs) for stat, vs in stats.items()} for name, stats in candidates.items()}
                for kind, candidates in record.whatif.items()
            }
        steps.append(step)
    wire: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "run": batch.run,
        "rank": batch.rank,
        "batch_id": batch.batch_id,
        "layers": list(batch.layers),
        "steps": steps,
    }
    if batch.actions:
        wire[ACTIONS_FIELD] = [action.wire() for action in batch.actions]
    if batch.layer_formats is not None:
        wire[LAYER_FORMATS_FIELD] = [None if kinds is None else dict(kinds) for kinds in batch.layer_formats]
    return wire


def encode_batch(batch: Batch, encoding: Encoding = "msgpack", compress: bool = True) -> EncodedBatch:
    """Encode ``batch`` as a request body (``encoding``: ``"msgpack"`` or ``"json"``; gzip when ``compress``)."""
    wire = to_wire_dict(batch, encoding)
    if encoding == "json":
        body = json.dumps(wire, separators=(",", ":"), allow_nan=False).encode()
    else:
        body = msgpack.packb(wire, use_bin_type=True)
    if compress:
        body = gzip.compress(body, compresslevel=_GZIP_LEVEL, mtime=0)
    return EncodedBatch(batch.batch_id, body, CONTENT_TYPES[encoding], compress, batch.point_count())


def wire_formats(layer: str, formats: Mapping[str, str]) -> Mapping[str, str] | None:
    """The formats of ``layer`` as the wire carries them: the kinds whose format the protocol can name (an adapter's
    own names are left out with one warning, so the collector never refuses a batch for them); None when none is
    left."""
    kept: dict[str, str] = {}
    for kind, value in formats.items():
        if value == "unknown":
            continue
        try:
            kept[kind] = check_layer_format(value)
        except ValueError as exc:
            logger.warning("quantwatch agent: %s: the %s format is not sent to the collector: %s", layer, kind, exc)
    return kept or None
