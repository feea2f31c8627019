"""Each layer's number format as the agent declares it (``layer_formats`` on the wire), kept with its history.

:class:`LayerFormatRecorder` is an ingest observer: inside the ingest transaction it records a layer's format per
tensor kind when it differs from the one in effect at the batch's first step (a batch's formats hold for all of its
steps), so a layer whose format changes mid-run keeps its history, each change with its step. The alert engine reads
the current formats through it (rules select layers by format; baseline-relative rules start again at a change).

:func:`layer_formats`, :func:`layer_format_history` and :func:`layer_format_answers` are the data-access reads.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from quantwatch.protocol.formats import TENSOR_KINDS
from quantwatch.service.alerts import repository
from quantwatch.service.alerts.evaluator import LayerFormatView

if TYPE_CHECKING:
    from quantwatch.service.batch import IngestBatch, StoredRun

__all__ = [
    "FormatChange",
    "LayerFormatRecorder",
    "RunFormats",
    "layer_format_answers",
    "layer_format_history",
    "layer_formats",
]


@dataclass(frozen=True)
class FormatChange:
    """From ``step`` on, ``layer`` quantizes its ``kind`` tensor to ``format``."""

    layer: str
    kind: str
    step: int
    format: str


@dataclass
class RunFormats:
    """A run's format history: per (layer, kind) the (step, format) changes in step order."""

    rows: int = 0
    history: dict[tuple[str, str], list[tuple[int, str]]] = field(default_factory=dict)
    _view: LayerFormatView | None = None

    @classmethod
    def of(cls, changes: list[tuple[str, str, int, str]]) -> RunFormats:
        """From (layer, kind, step, format) rows in step order."""
        formats = cls(rows=len(changes))
        for layer, kind, step, fmt in changes:
            formats.history.setdefault((layer, kind), []).append((step, fmt))
        return formats

    def at(self, layer: str, kind: str, step: int) -> str | None:
        """The format of ``layer``'s ``kind`` in effect at ``step`` (None before its first recorded one)."""
        changes = self.history.get((layer, kind), [])
        position = bisect.bisect_right(changes, step, key=lambda change: change[0])
        return changes[position - 1][1] if position else None

    def latest(self) -> dict[str, dict[str, str]]:
        """Each layer's newest format per kind."""
        current: dict[str, dict[str, str]] = {}
        for (layer, kind), changes in self.history.items():
            current.setdefault(layer, {})[kind] = changes[-1][1]
        return current

    def view(self) -> LayerFormatView:
        """What the evaluator needs: current formats and change steps per layer (computed once per history)."""
        if self._view is None:
            self._view = LayerFormatView(self.latest(), self.change_steps())
        return self._view

    def change_steps(self) -> dict[str, tuple[int, ...]]:
        """Per layer, the steps at which any of its formats changed, in order."""
        steps: dict[str, set[int]] = {}
        for (layer, _), changes in self.history.items():
            steps.setdefault(layer, set()).update(step for step, _ in changes)
        return {layer: tuple(sorted(found)) for layer, found in steps.items()}


class LayerFormatRecorder:
    """Ingest observer recording layer formats; keeps each run's history in memory, checked by a row count.

    The cache is per process: a batch re-reads a run's history whenever its number of recorded changes differs from
    the cached one (another replica recorded one, or a transaction that recorded one rolled back).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._cache: dict[int, RunFormats] = {}
        self._lock = threading.Lock()

    def current(self, session: Session, run_id: int, rows: int | None = None) -> RunFormats:
        """The format history of run ``run_id`` as this transaction sees it, given how many changes it has recorded
        (``rows``; counted when None)."""
        if rows is None:
            rows = repository.layer_format_count(session, run_id)
        with self._lock:
            cached = self._cache.get(run_id)
        if cached is not None and cached.rows == rows:
            return cached
        fresh = RunFormats.of(repository.layer_format_rows(session, run_id))
        with self._lock:
            self._cache[run_id] = fresh
        return fresh

    def on_batch(self, session: Session, run_row: StoredRun, batch: IngestBatch) -> None:
        """:class:`~quantwatch.service.batch.IngestObserver` hook: record the changes the batch declares."""
        if batch.layer_formats is None:
            return
        first = min(item.step for item in batch.steps)
        formats = self.current(session, run_row.id)
        now = self._clock()
        changes = [
            {"run_id": run_row.id, "layer": layer, "kind": kind, "step": first, "format": fmt, "recorded_at": now}
            for layer, kinds in zip(batch.layers, batch.layer_formats, strict=True)
            if kinds is not None
            for kind, fmt in kinds.items()
            if formats.at(layer, kind, first) != fmt
        ]
        if changes:
            repository.record_layer_formats(session, changes)

    def after_commit(self, batch: IngestBatch) -> None:
        """:class:`~quantwatch.service.batch.IngestObserver` hook: nothing to do after the commit."""


Sessions = Session | sessionmaker[Session]


def _session(source: Sessions) -> AbstractContextManager[Session]:
    # A session factory opens (and closes) a session; a caller's session is used as it is, left open.
    return source() if isinstance(source, sessionmaker) else nullcontext(source)


def layer_formats(sessions: Sessions, run: str) -> dict[str, dict[str, str]]:
    """Each layer's current format per tensor kind, ``{layer: {kind: format}}`` (layers of unknown format absent)."""
    with _session(sessions) as session:
        return RunFormats.of(repository.layer_format_rows(session, run)).latest()


def layer_format_history(sessions: Sessions, run: str) -> list[FormatChange]:
    """Every recorded format of the run's layers with the step it took effect, in step order."""
    with _session(sessions) as session:
        return [FormatChange(*row) for row in repository.layer_format_rows(session, run)]


def layer_format_answers(sessions: Sessions, run: str) -> dict[str, dict[str, Any]]:
    """Per layer with a recorded format, what ``GET /runs/{run}/layers`` answers about it: ``formats`` (each tensor
    kind's current format, null for a kind never declared) and, when any of its formats changed mid-run,
    ``format_changes`` (every recorded format with the step it took effect, in step order; else empty)."""
    per_layer: dict[str, list[FormatChange]] = {}
    for change in layer_format_history(sessions, run):
        per_layer.setdefault(change.layer, []).append(change)
    answers: dict[str, dict[str, Any]] = {}
    for layer, changes in per_layer.items():
        current = {change.kind: change.format for change in changes}  # step order: the last one wins
        changed = len(changes) > len(current)
        answers[layer] = {
            "formats": {kind: current.get(kind) for kind in TENSOR_KINDS},
            "format_changes": [
                {"step": change.step, "kind": change.kind, "format": change.format} for change in changes
            ]
            if changed
            else [],
        }
    return answers
