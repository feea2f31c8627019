"""The cross-rank checks as an ingest observer: fingerprints are stored with their batch, and a replica group's step
is compared once every rank of the group has reported it, whichever requests and collector replicas carried them.

How a comparison meets the alert engine: its result is written as ordinary ``rank_weight_mismatch`` points, one
synthetic batch per rank of the group (``batch_id`` ``ranks:<group>:<step>:<rank>``, so a comparison repeated by a
second replica or after a crash is a duplicate and stores nothing), through :meth:`Store.ingest` with the app's
ingest observers: the same storage, alert evaluation (the shipped rule ``quantwatch_rank_weight_mismatch``) and
Prometheus cache as measured points.  A rank that agrees with the reference gets 0, one that differs the relative
spread (:mod:`~quantwatch.service.ranks.compare`), so the episode of (rule, run, layer) names the differing ranks.

The decision runs after the batch's commit (each replica sees what the others committed), in step order per group;
the step's row in ``rank_comparisons`` (primary key) records it once.  A step still missing ranks
``wait_seconds`` after its first fingerprint arrived is recorded as ``incomplete`` — not a mismatch, no points (not
measured) — when the next fingerprints of the run arrive or its ranks are listed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby
from typing import Any, cast

import numpy as np
from sqlalchemy import Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from quantwatch.service.alerts.engine import insert_ignore
from quantwatch.service.batch import IngestBatch, IngestObserver, IngestStep, StoredRun
from quantwatch.service.core.db import write_session
from quantwatch.service.ranks.compare import Fingerprint, LayerVerdict, compare_layer
from quantwatch.service.ranks.tables import RankComparisonRow, RankEnvironmentRow, RankFingerprintRow
from quantwatch.service.store import Store

__all__ = ["METRIC", "RankChecks", "group_key"]

METRIC = "rank_weight_mismatch"
_PRINTS = cast(Table, RankFingerprintRow.__table__)
_DECIDED = cast(Table, RankComparisonRow.__table__)
_ENVIRONMENTS = cast(Table, RankEnvironmentRow.__table__)
log = logging.getLogger("quantwatch.service.ranks")


def group_key(group: Sequence[int]) -> str:
    """A short stable name of a replica group: ``"0-7"`` for a contiguous range, else a hash of its ranks."""
    if list(group) == list(range(group[0], group[0] + len(group))):
        return f"{group[0]}-{group[-1]}"
    return "h" + hashlib.blake2b(",".join(map(str, group)).encode(), digest_size=16).hexdigest()


def _prints_of(layers: Sequence[str], report: Any, step_time: float | None) -> dict[str, Any]:
    # float.hex keeps the sums exact and spells NaN/inf, which JSON (PostgreSQL's above all) cannot hold as numbers.
    entries = {
        layer: [h, float.hex(float("nan") if s is None else s), float.hex(float("nan") if q is None else q)]
        for layer, h, s, q in zip(layers, report.hash, report.sum, report.sumsq, strict=True)
        if h is not None
    }
    return {"group": list(report.group), "time": step_time, "layers": entries}


class RankChecks(IngestObserver):
    """Stores fingerprints and environments with their batch; compares complete steps after the commit."""

    def __init__(
        self,
        store: Store,
        observers: Callable[[], Sequence[IngestObserver]],
        *,
        wait_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.observers = observers
        self.wait_seconds = wait_seconds
        self.clock = clock

    def on_batch(self, session: Session, run_row: StoredRun, batch: IngestBatch) -> None:
        """Store the batch's fingerprints (first copy wins) and environment (last report wins)."""
        if not batch.rank_reports:
            return
        now = self.clock()
        times = {step.step: step.time for step in batch.steps}
        rows = [
            {
                "run": batch.run,
                "group_key": group_key(report.group),
                "step": report.step,
                "rank": batch.rank,
                "prints": _prints_of(batch.layers, report, times.get(report.step)),
                "received_at": now,
            }
            for report in batch.rank_reports
            if report.has_fingerprints
        ]
        insert_ignore(session, _PRINTS, rows, ["run", "group_key", "step", "rank"])
        environments = [r for r in batch.rank_reports if r.environment is not None]
        if environments:
            groups = [r.group for r in batch.rank_reports if r.has_fingerprints]
            values = {
                "run": batch.run,
                "rank": batch.rank,
                "environment": dict(environments[-1].environment or {}),
                "group_key": group_key(groups[-1]) if groups else "",
                "reported_at": now,
            }
            dialect_insert = postgresql.insert if session.connection().dialect.name == "postgresql" else sqlite.insert
            statement = dialect_insert(_ENVIRONMENTS).values(values)
            update = {k: statement.excluded[k] for k in ("environment", "group_key", "reported_at")}
            session.execute(statement.on_conflict_do_update(index_elements=["run", "rank"], set_=update))

    def after_commit(self, batch: IngestBatch) -> None:
        """Decide the steps of the batch's replica groups that are complete (or waited out)."""
        keys = {group_key(r.group) for r in batch.rank_reports if r.has_fingerprints}
        for key in sorted(keys):
            self.settle(batch.run, key)

    def settle_run(self, run: str) -> None:
        """Decide every pending step of ``run`` that is complete or waited out (a listing of its ranks does)."""
        with self.store.factory() as session:
            keys = session.scalars(select(_PRINTS.c.group_key).where(_PRINTS.c.run == run).distinct()).all()
        for key in keys:
            self.settle(run, key)

    def settle(self, run: str, key: str) -> None:
        """Decide the pending steps of one replica group in step order, up to the first that must wait longer."""
        with self.store.factory() as session:
            rows = session.execute(
                select(_PRINTS).where(_PRINTS.c.run == run, _PRINTS.c.group_key == key).order_by("step", "rank")
            ).all()
            pending = sorted({int(row.step) for row in rows})
            decided = set(
                session.scalars(
                    select(_DECIDED.c.step).where(
                        _DECIDED.c.run == run, _DECIDED.c.group_key == key, _DECIDED.c.step.in_(pending)
                    )
                )
            )
        now = self.clock()
        for step, group_rows in groupby(rows, key=lambda row: int(row.step)):
            at_step = list(group_rows)
            if step not in decided:
                group = set(at_step[0].prints["group"])
                reported = sorted(int(row.rank) for row in at_step)
                if group <= set(reported):
                    verdicts = self._compare(at_step)
                    times = [row.prints.get("time") for row in at_step]
                    step_time = max((t for t in times if t is not None), default=None)
                    self._write_points(run, key, step, step_time, sorted(group), verdicts)
                    status = "compared"
                elif now - min(float(row.received_at) for row in at_step) >= self.wait_seconds:
                    verdicts, status = [], "incomplete"
                else:
                    return
                self._decide(run, key, step, status, reported, verdicts, now)
            else:
                with write_session(self.store.factory) as session:
                    session.execute(delete(_PRINTS).where(*self._step_is(run, key, step)))

    @staticmethod
    def _step_is(run: str, key: str, step: int) -> tuple[Any, ...]:
        return _PRINTS.c.run == run, _PRINTS.c.group_key == key, _PRINTS.c.step == step

    @staticmethod
    def _compare(rows: Iterable[Any]) -> list[LayerVerdict]:
        by_layer: dict[str, dict[int, Fingerprint]] = {}
        for row in rows:
            for layer, (bits, total, square) in row.prints["layers"].items():
                by_layer.setdefault(layer, {})[int(row.rank)] = (bits, float.fromhex(total), float.fromhex(square))
        return [compare_layer(layer, prints) for layer, prints in by_layer.items()]

    def _write_points(
        self, run: str, key: str, step: int, step_time: float | None, group: list[int], verdicts: list[LayerVerdict]
    ) -> None:
        layers = tuple(v.layer for v in verdicts)
        if not layers:
            return
        observers = self.observers()
        for rank in group:
            values = np.array([v.values.get(rank, np.nan) for v in verdicts], dtype=np.float32)
            missing = np.array([rank not in v.values for v in verdicts])
            step_row = IngestStep(step, step_time, {METRIC: values}, {}, {METRIC: missing} if missing.any() else {})
            batch = IngestBatch(run, rank, f"ranks:{key}:{step}:{rank}", layers, (step_row,))
            self.store.ingest(batch, observers)

    def _decide(
        self, run: str, key: str, step: int, status: str, reported: list[int], verdicts: list[LayerVerdict], now: float
    ) -> None:
        mismatches = [
            {
                "layer": v.layer,
                "reference_rank": v.reference_rank,
                "majority": v.majority,
                "ranks": v.differing,
                "value": float.hex(max(v.values[r] for r in v.differing)),
            }
            for v in verdicts
            if v.differing
        ]
        row = {
            "run": run,
            "group_key": key,
            "step": step,
            "status": status,
            "reported": reported,
            "mismatches": mismatches,
            "decided_at": now,
        }
        with write_session(self.store.factory) as session:
            insert_ignore(session, _DECIDED, [row], ["run", "group_key", "step"])
            session.execute(delete(_PRINTS).where(*self._step_is(run, key, step)))
        if mismatches:
            log.warning("run %s step %d: ranks disagree on %d layer(s): %s", run, step, len(mismatches), mismatches[:3])
