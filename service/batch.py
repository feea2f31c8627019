"""The decoded ingest batch, the observer hook points, and the wire decoders (JSON and msgpack).

Decoding validates everything a client can get wrong and raises :class:`WireError` naming the field
(``steps[3].metrics.output_rel_l2``); the routes turn it into problem+json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from quantwatch.protocol import (
    ESTIMATED_FIELD,
    TENSOR_KINDS,
    WHATIF_FIELD,
    WHATIF_STATS,
    Action,
    BatchFields,
    check_candidate,
    check_layer_format,
    wire,
)
from quantwatch.service.ranks.decode import RankReport, decode_rank_reports
from quantwatch.service.rollups import F32, canonicalise
from quantwatch.service.wire_error import WireError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@dataclass(frozen=True)
class WhatIfEntry:
    """One layer's tensor ``kind`` quantized to ``candidate`` at a step: ``values[stat]`` for the stats of
    ``WHATIF_STATS`` it carries (None: not measured; NaN/±inf kept)."""

    layer: int
    kind: str
    candidate: str
    values: Mapping[str, float | None]


@dataclass(frozen=True)
class IngestStep:
    """One step of a batch.

    ``metrics[name]`` is a float32 array aligned with :attr:`IngestBatch.layers`; a value the agent did not measure
    (``null``) is NaN there and ``True`` in ``missing[name]``, which exists only for metrics with at least one null.
    Non-finite measured values (NaN, ±inf) are kept as they are: they are signals.
    """

    step: int
    time: float | None
    metrics: Mapping[str, F32]
    scalars: Mapping[str, float]
    missing: Mapping[str, np.ndarray] = field(default_factory=dict)
    estimated: frozenset[str] = frozenset()
    whatif: tuple[WhatIfEntry, ...] = ()


@dataclass(frozen=True)
class IngestBatch(BatchFields[IngestStep]):
    """A validated batch: run, rank, batch id, layer names (in the agent's model order), steps and layer formats;
    ``rank_reports`` are its steps' weight fingerprints and environment (:mod:`quantwatch.service.ranks`)."""

    rank_reports: tuple[RankReport, ...] = ()
    observed: dict[object, Any] = field(default_factory=dict, compare=False, repr=False)
    """What each ingest observer carries from its ``on_batch`` to its ``after_commit`` (and to the ingest answer),
    keyed by the observer: a value of the batch, not of a thread, so nothing a failed batch left behind reaches the
    next batch its thread stores, and the write path may run a batch's ``on_batch`` on another thread than the
    caller's (see :class:`IngestObserver`)."""

    @cached_property
    def step_numbers(self) -> list[int]:
        """The batch's steps, sorted (the write path reads its span, its newest step and its spacing)."""
        return sorted({step.step for step in self.steps})

    @cached_property
    def points(self) -> int:
        """Measured values in the batch (per-layer metric values plus scalars)."""
        total = 0
        for step in self.steps:
            total += len(step.scalars)
            for name, values in step.metrics.items():
                miss = step.missing.get(name)
                total += values.size - (int(miss.sum()) if miss is not None else 0)
        return total


@dataclass(frozen=True)
class StoredRun:
    """The run a batch is stored under, as the observers see it inside the ingest transaction (its id and name:
    building the ORM row per batch cost a tenth of a one-step batch)."""

    id: int
    name: str


@runtime_checkable
class IngestObserver(Protocol):
    """Something that reacts to ingested batches (alert evaluation, the Prometheus latest-value cache).

    ``on_batch`` runs inside the database transaction that stores the batch, after the points are written, holding
    the (run, rank)'s write lock (SQLite's database lock; PostgreSQL's rank advisory lock, which replicas share): rows
    it adds through ``session`` commit atomically with the points, and an exception aborts the whole batch (the
    client gets a 5xx and retries). ``after_commit`` runs once the batch is durable; its exceptions are logged, never
    raised. Duplicate batches (a repeated ``batch_id``) reach neither.

    State an observer keeps between the two lives in :attr:`IngestBatch.observed`, not per thread: ``on_batch`` need
    not run on the thread that runs ``after_commit``.
    """

    def on_batch(self, session: Session, run_row: StoredRun, batch: IngestBatch) -> None:
        """Called inside the ingest transaction."""

    def after_commit(self, batch: IngestBatch) -> None:
        """Called after the transaction committed."""


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise WireError(422, field, message)


def _number(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise WireError(422, field, "must be a number, null, or one of 'nan', 'inf', '-inf'")
    if isinstance(value, str):
        if value not in wire.NONFINITE_TOKENS:
            raise WireError(422, field, f"string {value[:20]!r} is not one of 'nan', 'inf', '-inf'")
        return wire.NONFINITE_TOKENS[value]
    return float(value)


def _metric_values(raw: Any, n_layers: int, field: str) -> tuple[F32, np.ndarray | None]:
    if isinstance(raw, bytes | bytearray):
        _require(len(raw) == 4 * n_layers, field, f"binary length {len(raw)} ≠ 4 × {n_layers} layers")
        return canonicalise(np.frombuffer(raw, dtype="<f4").astype(np.float32)), None
    _require(isinstance(raw, list), field, "must be an array of numbers (or a float32 bin in msgpack)")
    _require(len(raw) == n_layers, field, f"length {len(raw)} ≠ {n_layers} layers")
    values = np.empty(n_layers, dtype=np.float32)
    missing = np.zeros(n_layers, dtype=bool)
    with np.errstate(over="ignore"):
        for i, item in enumerate(raw):
            number = _number(item, f"{field}[{i}]")
            if number is None:
                missing[i] = True
                values[i] = np.nan
            else:
                values[i] = number
    return canonicalise(values), (missing if missing.any() else None)


def _int(value: Any, field: str, low: int, high: int) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), field, "must be an integer")
    _require(low <= value <= high, field, f"must be between {low} and {high}")
    return int(value)


def _step(raw: Any, n_layers: int, field: str, seen: set[int]) -> IngestStep:
    _require(isinstance(raw, dict), field, "must be an object")
    _require("step" in raw, f"{field}.step", "is required")
    step = _int(raw["step"], f"{field}.step", 0, wire.MAX_STEP)
    _require(step not in seen, f"{field}.step", f"step {step} appears twice in the batch")
    seen.add(step)
    time = _number(raw.get("time"), f"{field}.time")
    _require(time is None or math.isfinite(time), f"{field}.time", "must be finite seconds since the epoch")
    raw_metrics = raw.get("metrics") or {}
    _require(isinstance(raw_metrics, dict), f"{field}.metrics", "must be an object")
    metrics: dict[str, F32] = {}
    missing: dict[str, np.ndarray] = {}
    for name, values in raw_metrics.items():
        where = f"{field}.metrics.{name}"
        _require(
            isinstance(name, str) and wire.SERIES_NAME_PATTERN.fullmatch(name) is not None, where, "bad metric name"
        )
        arr, miss = _metric_values(values, n_layers, where)
        metrics[name] = arr
        if miss is not None:
            missing[name] = miss
    raw_scalars = raw.get("scalars") or {}
    _require(isinstance(raw_scalars, dict), f"{field}.scalars", "must be an object")
    scalars: dict[str, float] = {}
    for name, value in raw_scalars.items():
        where = f"{field}.scalars.{name}"
        _require(
            isinstance(name, str) and wire.SERIES_NAME_PATTERN.fullmatch(name) is not None, where, "bad scalar name"
        )
        number = _number(value, where)
        if number is not None:
            scalars[name] = number
    estimated = _estimated(raw.get(ESTIMATED_FIELD), metrics, f"{field}.{ESTIMATED_FIELD}")
    whatif = _whatif(raw.get(WHATIF_FIELD), n_layers, f"{field}.{WHATIF_FIELD}")
    return IngestStep(step, time, metrics, scalars, missing, estimated, whatif)


def _whatif(raw: Any, n_layers: int, field: str) -> tuple[WhatIfEntry, ...]:
    """A step's what-if statistics, one entry per (layer, kind, candidate) with at least one measured value."""
    if raw is None:
        return ()
    _require(isinstance(raw, dict), field, "must be an object of tensor kinds")
    entries: list[WhatIfEntry] = []
    for kind, candidates in raw.items():
        where = f"{field}.{kind}"
        _require(kind in TENSOR_KINDS, where, f"unknown tensor kind; known: {', '.join(TENSOR_KINDS)}")
        _require(isinstance(candidates, dict), where, "must be an object of candidates")
        for candidate, stats in candidates.items():
            at = f"{where}.{candidate}"
            try:
                check_candidate(candidate)
            except ValueError as exc:
                raise WireError(422, at, str(exc)) from None
            _require(isinstance(stats, dict), at, f"must be an object of {', '.join(WHATIF_STATS)}")
            columns: dict[str, tuple[F32, np.ndarray | None]] = {}
            for stat, values in stats.items():
                _require(stat in WHATIF_STATS, f"{at}.{stat}", f"unknown statistic; known: {', '.join(WHATIF_STATS)}")
                columns[stat] = _metric_values(values, n_layers, f"{at}.{stat}")
            for layer in range(n_layers):
                got = {
                    stat: None if miss is not None and miss[layer] else float(arr[layer])
                    for stat, (arr, miss) in columns.items()
                }
                if any(v is not None for v in got.values()):
                    entries.append(WhatIfEntry(layer, kind, candidate, got))
    return tuple(entries)


def _estimated(raw: Any, metrics: Mapping[str, F32], field: str) -> frozenset[str]:
    if raw is None:
        return frozenset()
    _require(isinstance(raw, list), field, "must be an array of the step's metric names")
    for i, name in enumerate(raw):
        _require(isinstance(name, str) and name in metrics, f"{field}[{i}]", "must name one of the step's metrics")
    _require(len(set(raw)) == len(raw), field, "names a metric twice")
    return frozenset(raw)


def _layer_formats(raw: Any, n_layers: int) -> tuple[Mapping[str, str] | None, ...] | None:
    if raw is None:
        return None
    field = wire.LAYER_FORMATS_FIELD
    _require(isinstance(raw, list), field, "must be an array aligned with `layers`")
    _require(len(raw) == n_layers, field, f"length {len(raw)} ≠ {n_layers} layers")
    formats: list[Mapping[str, str] | None] = []
    for i, entry in enumerate(raw):
        where = f"{field}[{i}]"
        if entry is None:
            formats.append(None)
            continue
        _require(isinstance(entry, dict), where, "must be null or an object of format strings by tensor kind")
        kinds: dict[str, str] = {}
        for kind, value in entry.items():
            _require(kind in TENSOR_KINDS, f"{where}.{kind}", f"unknown tensor kind; known: {', '.join(TENSOR_KINDS)}")
            try:
                kinds[kind] = check_layer_format(value)
            except ValueError as exc:
                raise WireError(422, f"{where}.{kind}", str(exc)) from None
        formats.append(kinds)
    return tuple(formats)


def _actions(raw: Any) -> tuple[Action, ...]:
    if raw is None:
        return ()
    field = wire.ACTIONS_FIELD
    _require(
        isinstance(raw, list) and len(raw) <= wire.MAX_ACTIONS, field, f"must be an array of <= {wire.MAX_ACTIONS}"
    )
    actions: list[Action] = []
    for i, entry in enumerate(raw):
        where = f"{field}[{i}]"
        _require(isinstance(entry, dict), where, "must be an object")
        kind = entry.get("action")
        _require(kind in wire.ACTION_KINDS, f"{where}.action", f"must be one of {', '.join(wire.ACTION_KINDS)}")
        texts = {}
        for key, limit in (("layer", wire.MAX_LAYER_NAME_LENGTH), ("detail", wire.MAX_ACTION_DETAIL_LENGTH)):
            value = entry.get(key, "")
            _require(isinstance(value, str) and len(value) <= limit, f"{where}.{key}", f"must be a string <= {limit}")
            _require("\x00" not in value, f"{where}.{key}", "must not contain NUL")
            texts[key] = value
        episode = entry.get("episode")
        step = _int(entry.get("step"), f"{where}.step", 0, wire.MAX_STEP)
        actions.append(
            Action(
                step,
                kind,
                texts["layer"],
                texts["detail"],
                None if episode is None else _int(episode, f"{where}.episode", 0, wire.MAX_STEP),
            )
        )
    return tuple(actions)


def _check_layer_names(layers: list[Any]) -> None:
    """Raise :class:`WireError` at the first name that is not a string of 1..MAX_LAYER_NAME_LENGTH chars without NUL.

    A valid list (every batch but a broken client's) is checked by builtins that loop in C: a Python loop over 512
    names took 0.15 ms of a one-step batch's decode, these 0.05–0.08 ms. Only a list that fails them is walked to
    name the field.
    """
    if not layers:
        return
    with suppress(TypeError):  # join refuses a list that holds anything but strings
        joined = "".join(layers)
        lengths = list(map(len, layers))
        if "\x00" not in joined and min(lengths) > 0 and max(lengths) <= wire.MAX_LAYER_NAME_LENGTH:
            return
    for i, name in enumerate(layers):
        if not (isinstance(name, str) and 0 < len(name) <= wire.MAX_LAYER_NAME_LENGTH):
            raise WireError(422, f"layers[{i}]", f"must be 1..{wire.MAX_LAYER_NAME_LENGTH} chars")
        if "\x00" in name:
            raise WireError(422, f"layers[{i}]", "must not contain NUL")


def batch_from_obj(obj: Any) -> IngestBatch:
    """Validate a decoded JSON/msgpack document into an :class:`IngestBatch` (raises :class:`WireError`)."""
    _require(isinstance(obj, dict), "", "the batch must be an object")
    run = obj.get("run")
    _require(
        isinstance(run, str) and wire.RUN_NAME_PATTERN.fullmatch(run) is not None,
        "run",
        f"must match {wire.RUN_NAME_RULE}",
    )
    rank = _int(obj.get("rank", 0), "rank", 0, wire.MAX_RANK)
    # A batch without a version is an older agent's (version 0); every version so far is read the same way.
    _int(obj.get("protocol", 0), "protocol", 0, wire.PROTOCOL_VERSION)
    batch_id = obj.get("batch_id")
    _require(
        isinstance(batch_id, str) and 1 <= len(batch_id) <= wire.MAX_BATCH_ID_LENGTH,
        "batch_id",
        f"must be a string of 1..{wire.MAX_BATCH_ID_LENGTH} chars",
    )
    _require("\x00" not in batch_id, "batch_id", "must not contain NUL")  # PostgreSQL text cannot store it
    layers = obj.get("layers", [])
    _require(isinstance(layers, list), "layers", "must be an array of layer names")
    _check_layer_names(layers)
    _require(len(set(layers)) == len(layers), "layers", "layer names must be unique")
    raw_steps = obj.get("steps")
    _require(isinstance(raw_steps, list) and len(raw_steps) > 0, "steps", "must be a non-empty array")
    seen: set[int] = set()
    steps = tuple(_step(raw, len(layers), f"steps[{i}]", seen) for i, raw in enumerate(raw_steps))
    formats = _layer_formats(obj.get(wire.LAYER_FORMATS_FIELD), len(layers))
    reports = decode_rank_reports(raw_steps, len(layers), rank)
    return IngestBatch(
        run=run,
        rank=rank,
        batch_id=batch_id,
        layers=tuple(layers),
        steps=steps,
        layer_formats=formats,
        actions=_actions(obj.get(wire.ACTIONS_FIELD)),
        rank_reports=reports,
    )


def decode_json(body: bytes) -> IngestBatch:
    """Decode and validate a JSON batch."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise WireError(400, "", f"malformed JSON: {exc}") from None
    return batch_from_obj(obj)


def decode_msgpack(body: bytes) -> IngestBatch:
    """Decode and validate a msgpack batch (metric arrays may be float32 ``bin``)."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise WireError(400, "", f"malformed msgpack: {type(exc).__name__}") from None
    return batch_from_obj(obj)
