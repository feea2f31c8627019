"""Storing and reading the what-if statistics (table ``whatif_points``, :mod:`quantwatch.service.whatif.tables`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.protocol import WHATIF_STATS
from quantwatch.service.models import Layer
from quantwatch.service.store.common import NotFoundError, find_run
from quantwatch.service.whatif.tables import WhatIfRow

if TYPE_CHECKING:
    from quantwatch.service.batch import IngestBatch, StoredRun

__all__ = ["WhatIfRecorder", "WhatIfStore"]

_COLUMNS = ("step", "layer", "kind", "candidate", "own", *WHATIF_STATS)


def _stored(value: float | None) -> float | None:
    # NaN is "no figure" in this table (SQLite cannot store it); ±inf are kept.
    return None if value is None or math.isnan(value) else value


class WhatIfRecorder:
    """The ingest observer that stores a batch's what-if entries in its transaction (a step sent again replaces its
    rows). First among the observers, so the alerts' remediation reads the batch's own figures."""

    def on_batch(self, session: Session, run_row: StoredRun, batch: IngestBatch) -> None:
        """Write the batch's what-if rows."""
        steps = [step for step in batch.steps if step.whatif]
        if not steps:
            return
        session.execute(
            delete(WhatIfRow).where(
                WhatIfRow.run_id == run_row.id,
                WhatIfRow.rank == batch.rank,
                WhatIfRow.step.in_([step.step for step in steps]),
            )
        )
        formats = batch.layer_formats or ()
        rows = []
        for step in steps:
            for entry in step.whatif:
                own = formats[entry.layer] if entry.layer < len(formats) else None
                row: dict[str, Any] = {
                    "run_id": run_row.id,
                    "rank": batch.rank,
                    "step": step.step,
                    "layer": batch.layers[entry.layer],
                    "kind": entry.kind,
                    "candidate": entry.candidate,
                    "own": own is not None and own.get(entry.kind) == entry.candidate,
                }
                row.update({stat: _stored(entry.values.get(stat)) for stat in WHATIF_STATS})
                rows.append(row)
        session.execute(insert(WhatIfRow), rows)

    def after_commit(self, batch: IngestBatch) -> None:
        """Nothing to do once committed."""


class WhatIfStore:
    """Reads of the what-if statistics."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory

    def at_step(self, run: str, rank: int, layer: str | None, step: int | None) -> dict[str, Any]:
        """The entries of ``layer`` (None: every layer) at ``step`` (None: the latest what-if step of that layer),
        with the what-if steps stored for it; raises NotFoundError for an unknown run or layer, or a step without
        what-if statistics."""
        with self.factory() as session:
            run_row = find_run(session, run)
            where = [WhatIfRow.run_id == run_row.id, WhatIfRow.rank == rank]
            if layer is not None:
                known = session.scalar(select(Layer.idx).where(Layer.run_id == run_row.id, Layer.name == layer))
                if known is None:
                    raise NotFoundError(f"layer {layer!r} not found in run {run!r}")
                where.append(WhatIfRow.layer == layer)
            steps = list(session.scalars(select(WhatIfRow.step).where(*where).distinct().order_by(WhatIfRow.step)))
            if step is None:
                step = steps[-1] if steps else None
            elif step not in steps:
                raise NotFoundError(f"no what-if statistics at step {step}" + (f" for {layer!r}" if layer else ""))
            entries = self._rows(session, run_row.id, where, step) if step is not None else []
        return {"run": run, "rank": rank, "layer": layer, "step": step, "steps": steps, "entries": entries}

    def window(self, run: str, rank: int, size: int) -> tuple[list[int], list[dict[str, Any]]]:
        """The last ``size`` what-if steps of ``run``'s ``rank`` and their entries (raises NotFoundError)."""
        with self.factory() as session:
            run_row = find_run(session, run)
            return self.window_in(session, run_row.id, rank, size)

    @staticmethod
    def has_entries(session: Session, run_id: int, rank: int) -> bool:
        """Whether ``rank`` of the run ``run_id`` stored any what-if statistics (one primary-key lookup)."""
        query = select(WhatIfRow.step).where(WhatIfRow.run_id == run_id, WhatIfRow.rank == rank).limit(1)
        return session.scalar(query) is not None

    def window_in(
        self, session: Session, run_id: int, rank: int, size: int, layer: str | None = None
    ) -> tuple[list[int], list[dict[str, Any]]]:
        """:meth:`window` within ``session`` for a run id, optionally of one layer."""
        where = [WhatIfRow.run_id == run_id, WhatIfRow.rank == rank]
        if layer is not None:
            where.append(WhatIfRow.layer == layer)
        recent = select(WhatIfRow.step).where(*where).distinct().order_by(WhatIfRow.step.desc()).limit(size)
        steps = sorted(session.scalars(recent))
        if not steps:
            return [], []
        return steps, self._rows(session, run_id, [*where, WhatIfRow.step >= steps[0]], None)

    @staticmethod
    def _rows(session: Session, run_id: int, where: list[Any], step: int | None) -> list[dict[str, Any]]:
        """Rows in the run's layer order, then kind, then candidate."""
        if step is not None:
            where = [*where, WhatIfRow.step == step]
        order = select(Layer.idx).where(Layer.run_id == run_id, Layer.name == WhatIfRow.layer).scalar_subquery()
        query = (
            select(*(getattr(WhatIfRow, c) for c in _COLUMNS))
            .where(*where)
            .order_by(WhatIfRow.step, order, WhatIfRow.kind, WhatIfRow.candidate)
        )
        return [dict(zip(_COLUMNS, row, strict=True)) for row in session.execute(query)]
