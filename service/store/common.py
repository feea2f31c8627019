"""What the store's modules share: its errors and answers, the per-process cache of a run, small read helpers."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from quantwatch.service.models import Run
from quantwatch.service.rollups import I64


class NotFoundError(LookupError):
    """A run, layer, metric or scalar that does not exist (HTTP 404)."""


@dataclass(frozen=True)
class IngestResult:
    """What ingest answers: the batch id, whether it was a duplicate, and the points stored."""

    batch_id: str
    duplicate: bool
    points: int


@dataclass
class RunCache:
    """Immutable facts of one run kept per process: its layers in order, their index, the (name id, kind) pairs."""

    layers: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    kinds: set[tuple[int, str]] = field(default_factory=set)


def choose_width(start: int, end: int, max_points: int) -> int:
    """Smallest power-of-two bucket width whose aligned buckets over [start, end] number at most ``max_points``."""
    width = 1
    while end // width - start // width + 1 > max_points:
        width *= 2
    return width


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


def columns(rows: Sequence[Any]) -> tuple[I64, list[bytes]]:
    """The (step or bucket, blob) rows of a read as an int64 array and a list of bytes, without a Python-level loop
    per row (a long series read returns ~800 rows, a raw one up to ~64,000). Not ``zip(*rows)``: that allocates an
    iterator per row, which the garbage collector tracks, and in the collector's large heap the collections it set
    off made raw reads of 20,000 rows several times slower at the median."""
    keys = np.fromiter(map(_first, rows), dtype=np.int64, count=len(rows))
    return keys, list(map(bytes, map(_second, rows)))


def find_run(session: Session, name: str) -> Run:
    """The run called ``name`` (raises NotFoundError)."""
    run = session.execute(select(Run).where(Run.name == name)).scalar_one_or_none()
    if run is None:
        raise NotFoundError(f"run {name!r} not found")
    return run
