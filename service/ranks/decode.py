"""Decoding the rank fields of an ingest step (protocol ``FINGERPRINT_FIELD`` and ``ENVIRONMENT_FIELD``).

:func:`decode_rank_reports` is called once by the batch decoder (``service/batch.py``) and raises its
:class:`~quantwatch.service.wire_error.WireError` naming the field (``steps[2].fingerprints.hash[1]``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quantwatch.protocol import (
    ENVIRONMENT_FIELD,
    FINGERPRINT_FIELD,
    FINGERPRINT_HASH_RULE,
    MAX_ENVIRONMENT_VALUE_LENGTH,
    MAX_RANK,
    MAX_REPLICA_GROUP,
    NONFINITE_TOKENS,
    SERIES_NAME_PATTERN,
)
from quantwatch.service.wire_error import WireError

__all__ = ["RankReport", "decode_rank_reports"]

_HASH = re.compile(FINGERPRINT_HASH_RULE)


@dataclass(frozen=True)
class RankReport:
    """What one step of a batch says about its rank: fingerprints (aligned with the batch's layers, ``None`` where a
    layer has no weight) with the replica group, and/or the environment."""

    step: int
    group: tuple[int, ...] = ()
    sum: tuple[float | None, ...] = ()
    sumsq: tuple[float | None, ...] = ()
    hash: tuple[str | None, ...] = ()
    environment: Mapping[str, str] | None = None

    @property
    def has_fingerprints(self) -> bool:
        """Whether the step carried fingerprints."""
        return bool(self.group)


def _fail(field: str, message: str) -> WireError:
    return WireError(422, field, message)


def _numbers(raw: Any, n: int, field: str) -> tuple[float | None, ...]:
    if not isinstance(raw, list) or len(raw) != n:
        raise _fail(field, f"must be an array of {n} numbers or nulls (one per layer)")
    out: list[float | None] = []
    for i, value in enumerate(raw):
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            out.append(None if value is None else float(value))
        elif isinstance(value, str) and value in NONFINITE_TOKENS:
            out.append(NONFINITE_TOKENS[value])
        else:
            raise _fail(f"{field}[{i}]", "must be a number, null, or one of 'nan', 'inf', '-inf'")
    return tuple(out)


def _fingerprints(
    raw: Any, n: int, rank: int, field: str
) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[Any, ...], Any]:
    if not isinstance(raw, dict):
        raise _fail(field, "must be an object with group, sum, sumsq and hash")
    group = raw.get("group")
    if not isinstance(group, list) or not 1 <= len(group) <= MAX_REPLICA_GROUP:
        raise _fail(f"{field}.group", f"must be an array of 1..{MAX_REPLICA_GROUP} ranks")
    for i, member in enumerate(group):
        if not isinstance(member, int) or isinstance(member, bool) or not 0 <= member <= MAX_RANK:
            raise _fail(f"{field}.group[{i}]", f"must be an integer rank 0..{MAX_RANK}")
    if len(set(group)) != len(group):
        raise _fail(f"{field}.group", "ranks must be unique")
    if rank not in group:
        raise _fail(f"{field}.group", f"must include the batch's rank {rank}")
    hashes = raw.get("hash")
    if not isinstance(hashes, list) or len(hashes) != n:
        raise _fail(f"{field}.hash", f"must be an array of {n} hex strings or nulls (one per layer)")
    for i, value in enumerate(hashes):
        if value is not None and not (isinstance(value, str) and _HASH.fullmatch(value)):
            raise _fail(f"{field}.hash[{i}]", f"must be null or match {FINGERPRINT_HASH_RULE}")
    sums = _numbers(raw.get("sum"), n, f"{field}.sum")
    sumsqs = _numbers(raw.get("sumsq"), n, f"{field}.sumsq")
    return tuple(sorted(group)), sums, sumsqs, tuple(hashes)


def _environment(raw: Any, field: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise _fail(field, "must be an object of strings")
    for key, value in raw.items():
        if not (isinstance(key, str) and SERIES_NAME_PATTERN.fullmatch(key)):
            raise _fail(field, f"bad key {str(key)[:40]!r}")
        if not isinstance(value, str) or len(value) > MAX_ENVIRONMENT_VALUE_LENGTH or "\x00" in value:
            raise _fail(f"{field}.{key}", f"must be a string of at most {MAX_ENVIRONMENT_VALUE_LENGTH} chars")
    return dict(raw)


def decode_rank_reports(raw_steps: Sequence[Any], n_layers: int, rank: int) -> tuple[RankReport, ...]:
    """The rank reports of a batch's (already validated) raw steps from ``rank``: one per step that carries either
    field."""
    reports: list[RankReport] = []
    for i, raw in enumerate(raw_steps):
        fingerprints, environment = raw.get(FINGERPRINT_FIELD), raw.get(ENVIRONMENT_FIELD)
        if fingerprints is None and environment is None:
            continue
        field = f"steps[{i}]"
        group: tuple[int, ...] = ()
        sums: tuple[float | None, ...] = ()
        sumsqs: tuple[float | None, ...] = ()
        hashes: tuple[str | None, ...] = ()
        if fingerprints is not None:
            group, sums, sumsqs, hashes = _fingerprints(fingerprints, n_layers, rank, f"{field}.{FINGERPRINT_FIELD}")
        env = None if environment is None else _environment(environment, f"{field}.{ENVIRONMENT_FIELD}")
        reports.append(RankReport(int(raw["step"]), group, sums, sumsqs, hashes, env))
    return tuple(reports)
