"""All database access of the collector: ingest (points, rollups, bookkeeping) and history queries.

See README "Storage" for the layout. Writers of one (run, rank) are serialised (SQLite: one writer at a time;
PostgreSQL: a transaction-scoped advisory lock), which makes read-merge-write of rollups and last-write-wins merges of
re-sent points safe with several collector replicas on one database.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import logging
import math
import operator
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, Integer, and_, bindparam, delete, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.batch import IngestBatch, IngestObserver
from quantwatch.service.models import (
    Batch,
    Layer,
    MetricName,
    Point,
    Rollup,
    Run,
    RunMetric,
    RunRank,
    ScalarPoint,
)
from quantwatch.service.rollups import (
    F32,
    I64,
    LEVELS,
    MISSING_BITS,
    STATS_DTYPE,
    Partials,
    group_starts,
    is_missing,
    missing_row,
    rows_from_blobs,
    to_json_floats,
    to_json_matrix,
)

log = logging.getLogger("quantwatch.service")

RUN_LOCK_TAG = 1 << 40
RANK_LOCK_SPAN = 1 << 20


class NotFoundError(LookupError):
    """A run, layer, metric or scalar that does not exist (HTTP 404)."""


@dataclass(frozen=True)
class IngestResult:
    """What ingest answers: the batch id, whether it was a duplicate, and the points stored."""

    batch_id: str
    duplicate: bool
    points: int


@dataclass
class _RunCache:
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


def _columns(rows: Sequence[Any]) -> tuple[I64, list[bytes]]:
    """The (step or bucket, blob) rows of a read as an int64 array and a list of bytes, without a Python-level loop
    per row (a long series read returns ~800 rows, a raw one up to ~64,000). Not ``zip(*rows)``: that allocates an
    iterator per row, which the garbage collector tracks, and in the collector's large heap the collections it set
    off made raw reads of 20,000 rows several times slower at the median."""
    keys = np.fromiter(map(_first, rows), dtype=np.int64, count=len(rows))
    return keys, list(map(bytes, map(_second, rows)))


def _json_value(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


class Store:
    """Data access for one engine; holds small caches of immutable facts (name ids, layer order) per process."""

    def __init__(self, engine: Engine, factory: sessionmaker[Session]) -> None:
        self.engine = engine
        self.factory = factory
        self.pg = engine.dialect.name == "postgresql"
        self._insert = postgresql.insert if self.pg else sqlite.insert
        rollup = self._insert(Rollup)
        # Built once: constructing and cache-keying Core statements per batch cost more than executing them.
        self._rollup_upsert = rollup.on_conflict_do_update(
            index_elements=["run_id", "rank", "name_id", "level", "bucket"],
            set_={"stats": rollup.excluded.stats},
        )
        self._rollup_select = (
            select(Rollup.name_id, Rollup.bucket, Rollup.stats)
            .where(
                Rollup.run_id == bindparam("run_id"),
                Rollup.rank == bindparam("rank"),
                Rollup.name_id.in_(bindparam("nids", expanding=True)),
                Rollup.level == bindparam("level"),
                Rollup.bucket >= bindparam("lo"),
                Rollup.bucket <= bindparam("hi"),
            )
            .order_by(Rollup.name_id, Rollup.bucket)
        )
        point = self._insert(Point)
        self._point_upsert = point.on_conflict_do_update(
            index_elements=["run_id", "rank", "step", "name_id"],
            set_={"vals": point.excluded.vals, "time": point.excluded.time},
        )
        self._build_read_statements()
        self._names: dict[str, int] = {}
        self._runs: dict[int, _RunCache] = {}
        self._lock = threading.Lock()

    def _build_read_statements(self) -> None:
        """Prebuilt statements of the history reads (a series answer runs four of them; building each per call cost
        more than executing it)."""
        offset = bindparam("offset", type_=Integer)
        points = (
            Point.run_id == bindparam("run_id"),
            Point.rank == bindparam("rank"),
            Point.name_id == bindparam("nid"),
            Point.step >= bindparam("lo"),
            Point.step <= bindparam("hi"),
        )
        self._raw_rows = select(Point.step, Point.vals).where(*points).order_by(Point.step)
        self._raw_layer_rows = (
            select(Point.step, func.substr(Point.vals, offset, 4)).where(*points).order_by(Point.step)
        )
        self._raw_count = select(func.count()).select_from(
            select(Point.step).where(*points).limit(bindparam("limit", type_=Integer)).subquery()
        )
        blocks = (
            Rollup.run_id == bindparam("run_id"),
            Rollup.rank == bindparam("rank"),
            Rollup.name_id == bindparam("nid"),
            Rollup.level == bindparam("level"),
            Rollup.bucket >= bindparam("lo"),
            Rollup.bucket <= bindparam("hi"),
        )
        self._block_rows = select(Rollup.bucket, Rollup.stats).where(*blocks).order_by(Rollup.bucket)
        self._block_layer_rows = (
            select(Rollup.bucket, func.substr(Rollup.stats, offset, STATS_DTYPE.itemsize))
            .where(*blocks)
            .order_by(Rollup.bucket)
        )
        # Everything a series read needs to know before reading values, in one round trip: the run, the layer's
        # index, the metric's id (only if the run has sent it) and the rank's step range (NULL where absent).
        self._series_keys = (
            select(Run.id, Run.layer_count, Layer.idx, RunMetric.name_id, RunRank.first_step, RunRank.last_step)
            .select_from(Run)
            .outerjoin(Layer, and_(Layer.run_id == Run.id, Layer.name == bindparam("layer")))
            .outerjoin(MetricName, MetricName.name == bindparam("metric"))
            .outerjoin(
                RunMetric,
                and_(RunMetric.run_id == Run.id, RunMetric.name_id == MetricName.id, RunMetric.kind == "layer"),
            )
            .outerjoin(RunRank, and_(RunRank.run_id == Run.id, RunRank.rank == bindparam("rank")))
            .where(Run.name == bindparam("run"))
        )

    # ---------------------------------------------------------------- ingest
    def ingest(self, batch: IngestBatch, observers: Sequence[IngestObserver] = ()) -> IngestResult:
        """Store ``batch`` atomically, or recognise it as a duplicate; run the observers (see IngestObserver)."""
        now = time.time()
        points = batch.points
        pending_names: dict[str, int] = {}
        with self.factory() as session:
            conn = session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            try:
                run_id, layer_count = self._ensure_run(conn, batch.run, now)
                inserted = conn.execute(
                    self._insert(Batch)
                    .values(run_id=run_id, batch_id=batch.batch_id, rank=batch.rank, received_at=now, points=points)
                    .on_conflict_do_nothing()
                    .returning(Batch.batch_id)
                ).first()
                if inserted is None:
                    session.rollback()
                    return IngestResult(batch.batch_id, True, 0)
                if self.pg:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": self._rank_key(run_id, batch.rank)})
                    # Read the layer count again under the rank lock: a transaction of this rank that committed
                    # while we waited may have widened the run, and its rollup blobs with it.
                    layer_count = conn.execute(select(Run.layer_count).where(Run.id == run_id)).scalar_one()
                cache = self._run_cache(conn, run_id, layer_count)
                layers, index = self._ensure_layers(conn, run_id, cache, batch.layers)
                names = {n for s in batch.steps for n in s.metrics} | {n for s in batch.steps for n in s.scalars}
                name_ids = self._name_ids(conn, sorted(names), pending_names)
                self._write_run_metrics(conn, run_id, batch, name_ids, cache)
                self._write_points(conn, run_id, batch, layers, index, name_ids)
                self._write_scalars(conn, run_id, batch, name_ids)
                self._write_rank(conn, run_id, batch, now, points)
                if observers:
                    run_row = session.get(Run, run_id)
                    if run_row is None:  # the row was inserted or read above in this very transaction
                        raise LookupError(f"run {batch.run!r} vanished during ingest")
                    for observer in observers:
                        observer.on_batch(session, run_row, batch)
                session.commit()
            except BaseException:
                session.rollback()
                raise
        with self._lock:
            self._names.update(pending_names)
            self._runs[run_id] = _RunCache(list(layers), dict(index), cache.kinds | self._new_kinds(batch, name_ids))
        for observer in observers:
            try:
                observer.after_commit(batch)
            except Exception:
                log.exception("ingest observer %r failed after commit", observer)
        return IngestResult(batch.batch_id, False, points)

    @staticmethod
    def _rank_key(run_id: int, rank: int) -> int:
        return run_id * RANK_LOCK_SPAN + rank % (RANK_LOCK_SPAN - 1) + 1

    @staticmethod
    def _new_kinds(batch: IngestBatch, name_ids: dict[str, int]) -> set[tuple[int, str]]:
        kinds = {(name_ids[n], "layer") for s in batch.steps for n in s.metrics}
        return kinds | {(name_ids[n], "scalar") for s in batch.steps for n in s.scalars}

    def _ensure_run(self, conn: Connection, name: str, now: float) -> tuple[int, int]:
        row = conn.execute(select(Run.id, Run.layer_count).where(Run.name == name)).first()
        if row is None:
            conn.execute(self._insert(Run).values(name=name, created_at=now, layer_count=0).on_conflict_do_nothing())
            row = conn.execute(select(Run.id, Run.layer_count).where(Run.name == name)).one()
        return int(row[0]), int(row[1])

    def _run_cache(self, conn: Connection, run_id: int, layer_count: int) -> _RunCache:
        cached = self._runs.get(run_id)
        if cached is not None and len(cached.layers) == layer_count:
            return _RunCache(list(cached.layers), dict(cached.index), set(cached.kinds))
        layers = [r[0] for r in conn.execute(select(Layer.name).where(Layer.run_id == run_id).order_by(Layer.idx))]
        kinds = {
            (int(r[0]), str(r[1]))
            for r in conn.execute(select(RunMetric.name_id, RunMetric.kind).where(RunMetric.run_id == run_id))
        }
        return _RunCache(layers, {n: i for i, n in enumerate(layers)}, kinds)

    def _ensure_layers(
        self, conn: Connection, run_id: int, cache: _RunCache, names: Sequence[str]
    ) -> tuple[list[str], dict[str, int]]:
        if all(n in cache.index for n in names):
            return cache.layers, cache.index
        if self.pg:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": RUN_LOCK_TAG + run_id})
        layers = [r[0] for r in conn.execute(select(Layer.name).where(Layer.run_id == run_id).order_by(Layer.idx))]
        index = {n: i for i, n in enumerate(layers)}
        new = [n for n in names if n not in index]
        if new:
            conn.execute(
                self._insert(Layer),
                [{"run_id": run_id, "idx": len(layers) + i, "name": n} for i, n in enumerate(new)],
            )
            for n in new:
                index[n] = len(layers)
                layers.append(n)
            conn.execute(update(Run).where(Run.id == run_id).values(layer_count=len(layers)))
        return layers, index

    def _name_ids(self, conn: Connection, names: Sequence[str], pending: dict[str, int]) -> dict[str, int]:
        ids = {n: self._names[n] for n in names if n in self._names}
        unknown = [n for n in names if n not in ids]
        if unknown:
            conn.execute(self._insert(MetricName).on_conflict_do_nothing(), [{"name": n} for n in unknown])
            for row in conn.execute(select(MetricName.name, MetricName.id).where(MetricName.name.in_(unknown))):
                ids[row[0]] = int(row[1])
                pending[row[0]] = int(row[1])
        return ids

    def _write_run_metrics(
        self, conn: Connection, run_id: int, batch: IngestBatch, name_ids: dict[str, int], cache: _RunCache
    ) -> None:
        rows = [
            {"run_id": run_id, "name_id": nid, "kind": kind}
            for nid, kind in self._new_kinds(batch, name_ids) - cache.kinds
        ]
        if rows:
            conn.execute(self._insert(RunMetric).on_conflict_do_nothing(), rows)

    def _write_points(
        self,
        conn: Connection,
        run_id: int,
        batch: IngestBatch,
        layers: list[str],
        index: dict[str, int],
        name_ids: dict[str, int],
    ) -> None:
        n_layers = len(layers)
        columns = np.array([index[n] for n in batch.layers], dtype=np.int64)
        identity = len(columns) == n_layers and bool(np.all(columns == np.arange(n_layers)))
        steps_by_metric: dict[str, list[tuple[int, float | None, F32]]] = {}
        for st in sorted(batch.steps, key=lambda s: s.step):
            for name, values in st.metrics.items():
                if identity:
                    full = values.copy()
                else:
                    full = missing_row(n_layers)
                    full[columns] = values
                miss = st.missing.get(name)
                if miss is not None:
                    full.view(np.uint32)[columns[miss]] = MISSING_BITS
                steps_by_metric.setdefault(name, []).append((st.step, st.time, full))
        if not steps_by_metric:
            return
        lo = min(s.step for s in batch.steps)
        hi = max(s.step for s in batch.steps)
        existing = {
            (int(r[0]), int(r[1]))
            for r in conn.execute(
                select(Point.step, Point.name_id).where(
                    Point.run_id == run_id, Point.rank == batch.rank, Point.step >= lo, Point.step <= hi
                )
            )
        }
        rows: list[dict[str, Any]] = []
        replaced: dict[int, list[int]] = {}
        matrices: dict[int, tuple[I64, F32]] = {}
        for name, entries in steps_by_metric.items():
            nid = name_ids[name]
            steps = np.array([e[0] for e in entries], dtype=np.int64)
            values = np.stack([e[2] for e in entries])
            hits = [i for i, s in enumerate(steps.tolist()) if (s, nid) in existing]
            if hits:
                old_rows = {
                    int(r[0]): r[1]
                    for r in conn.execute(
                        select(Point.step, Point.vals).where(
                            Point.run_id == run_id,
                            Point.rank == batch.rank,
                            Point.name_id == nid,
                            Point.step.in_([int(steps[i]) for i in hits]),
                        )
                    )
                }
                old = rows_from_blobs([old_rows[int(steps[i])] for i in hits], n_layers)
                new = values[hits]
                # Last write wins per (layer, step): a re-sent step replaces what it measures, keeps the rest.
                values[hits] = np.where(is_missing(new), old, new)
                replaced[nid] = [int(steps[i]) for i in hits]
            matrices[nid] = (steps, values)
            times = [e[1] for e in entries]
            blob = values.astype("<f4", copy=False)
            rows.extend(
                {
                    "run_id": run_id,
                    "rank": batch.rank,
                    "step": int(steps[i]),
                    "name_id": nid,
                    "time": times[i],
                    "vals": blob[i].tobytes(),
                }
                for i in range(len(entries))
            )
        conn.execute(self._point_upsert, rows)
        self._write_rollups(conn, run_id, batch.rank, matrices, set(replaced), n_layers)

    def _read_rollups(
        self, conn: Connection, run_id: int, rank: int, nids: Sequence[int], level: int, lo: int, hi: int, n_layers: int
    ) -> dict[int, tuple[I64, Partials]]:
        """Stored blocks of ``level`` with bucket in [lo, hi] for each of ``nids``, by name id, bucket order."""
        rows = conn.execute(
            self._rollup_select,
            {"run_id": run_id, "rank": rank, "nids": list(nids), "level": level, "lo": lo, "hi": hi},
        ).all()
        out: dict[int, tuple[I64, Partials]] = {}
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][0] != rows[start][0]:
                chunk = rows[start:i]
                out[int(rows[start][0])] = (
                    np.array([r[1] for r in chunk], dtype=np.int64),
                    Partials.from_stats([r[2] for r in chunk], n_layers),
                )
                start = i
        return out

    def _write_rollups(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        matrices: dict[int, tuple[I64, F32]],
        replaced: set[int],
        n_layers: int,
    ) -> None:
        """Bring every rollup level up to date for the batch's steps, all metrics at once per level."""
        base = LEVELS[0]
        level_parts: dict[int, tuple[I64, Partials]] = {}
        fresh = [nid for nid in matrices if nid not in replaced]
        if fresh:
            lo = min(int(matrices[nid][0][0]) for nid in fresh) // base
            hi = max(int(matrices[nid][0][-1]) for nid in fresh) // base
            stored_all = self._read_rollups(conn, run_id, rank, fresh, base, lo, hi, n_layers)
        for nid, (steps, values) in matrices.items():
            if nid in replaced:
                # Replaced values cannot be subtracted from a min or max: recompute the touched blocks from raw.
                touched = steps // base
                raw = conn.execute(
                    select(Point.step, Point.vals)
                    .where(
                        Point.run_id == run_id,
                        Point.rank == rank,
                        Point.name_id == nid,
                        Point.step >= int(touched.min()) * base,
                        Point.step <= (int(touched.max()) + 1) * base - 1,
                    )
                    .order_by(Point.step)
                ).all()
                keys, starts = group_starts(np.array([r[0] for r in raw], dtype=np.int64) // base)
                part = Partials.from_values(rows_from_blobs([r[1] for r in raw], n_layers)).reduce(starts)
            else:
                keys, starts = group_starts(steps // base)
                part = Partials.from_values(values).reduce(starts)
                old_keys, old = stored_all.get(nid, (np.zeros(0, dtype=np.int64), Partials.empty(0, n_layers)))
                if old_keys.size:
                    pos = np.searchsorted(keys, old_keys)
                    hit = (pos < keys.size) & (keys[np.minimum(pos, keys.size - 1)] == old_keys)
                    stored = Partials.empty(keys.size, n_layers)
                    stored.vmin[pos[hit]] = old.vmin[hit]
                    stored.vmax[pos[hit]] = old.vmax[hit]
                    stored.vsum[pos[hit]] = old.vsum[hit]
                    stored.vcount[pos[hit]] = old.vcount[hit]
                    part = part.merge(stored)
            level_parts[nid] = (keys, part)
        self._upsert_rollups(conn, run_id, rank, base, level_parts)
        below = base
        for level in LEVELS[1:]:
            factor = level // below
            lo_b = min(int(k[0]) for k, _ in level_parts.values()) // factor
            hi_b = max(int(k[-1]) for k, _ in level_parts.values()) // factor
            children = self._read_rollups(
                conn, run_id, rank, list(level_parts), below, lo_b * factor, (hi_b + 1) * factor - 1, n_layers
            )
            # Only the blocks above this batch's blocks change; recombine each from its (at most 4) children.
            wanted = {nid: np.unique(k // factor) for nid, (k, _) in level_parts.items()}
            next_parts: dict[int, tuple[I64, Partials]] = {}
            for nid, (child_keys, child) in children.items():
                keep = np.isin(child_keys // factor, wanted[nid])
                keys, starts = group_starts(child_keys[keep] // factor)
                next_parts[nid] = (keys, child.take(np.flatnonzero(keep)).reduce(starts))
            self._upsert_rollups(conn, run_id, rank, level, next_parts)
            level_parts = next_parts
            below = level

    def _upsert_rollups(
        self, conn: Connection, run_id: int, rank: int, level: int, parts: dict[int, tuple[I64, Partials]]
    ) -> None:
        rows = []
        for nid, (keys, part) in parts.items():
            for i, bucket in enumerate(keys.tolist()):
                rows.append(
                    {
                        "run_id": run_id,
                        "rank": rank,
                        "name_id": nid,
                        "level": level,
                        "bucket": bucket,
                        "stats": part.stats(i),
                    }
                )
        if rows:
            conn.execute(self._rollup_upsert, rows)

    def _write_scalars(self, conn: Connection, run_id: int, batch: IngestBatch, name_ids: dict[str, int]) -> None:
        rows = [
            {
                "run_id": run_id,
                "rank": batch.rank,
                "name_id": name_ids[name],
                "step": st.step,
                "time": st.time,
                "value": struct.pack("<d", value),
            }
            for st in batch.steps
            for name, value in st.scalars.items()
        ]
        if rows:
            stmt = self._insert(ScalarPoint)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["run_id", "rank", "name_id", "step"],
                    set_={"value": stmt.excluded.value, "time": stmt.excluded.time},
                ),
                rows,
            )

    def _write_rank(self, conn: Connection, run_id: int, batch: IngestBatch, now: float, points: int) -> None:
        lo = min(s.step for s in batch.steps)
        hi = max(s.step for s in batch.steps)
        stmt = self._insert(RunRank).values(
            run_id=run_id, rank=batch.rank, first_step=lo, last_step=hi, last_seen_at=now, points=points
        )
        least, greatest = (func.least, func.greatest) if self.pg else (func.min, func.max)
        table = RunRank.__table__
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "rank"],
                set_={
                    "first_step": least(table.c.first_step, stmt.excluded.first_step),
                    "last_step": greatest(table.c.last_step, stmt.excluded.last_step),
                    "last_seen_at": stmt.excluded.last_seen_at,
                    "points": table.c.points + stmt.excluded.points,
                },
            )
        )

    # ---------------------------------------------------------------- runs
    def _run(self, session: Session, name: str) -> Run:
        run = session.execute(select(Run).where(Run.name == name)).scalar_one_or_none()
        if run is None:
            raise NotFoundError(f"run {name!r} not found")
        return run

    def _summaries(self, session: Session, runs: Sequence[Run]) -> list[dict[str, Any]]:
        ids = [r.id for r in runs]
        if not ids:
            return []
        ranks: dict[int, list[Any]] = {}
        for row in session.execute(select(RunRank).where(RunRank.run_id.in_(ids)).order_by(RunRank.rank)).scalars():
            ranks.setdefault(row.run_id, []).append(row)
        kinds: dict[int, dict[str, list[str]]] = {}
        for run_id, name, kind in session.execute(
            select(RunMetric.run_id, MetricName.name, RunMetric.kind)
            .join(MetricName, MetricName.id == RunMetric.name_id)
            .where(RunMetric.run_id.in_(ids))
            .order_by(MetricName.name)
        ):
            kinds.setdefault(run_id, {"layer": [], "scalar": []})[kind].append(name)
        out = []
        for run in runs:
            rr = ranks.get(run.id, [])
            k = kinds.get(run.id, {"layer": [], "scalar": []})
            out.append(
                {
                    "name": run.name,
                    "created_at": run.created_at,
                    "first_step": min((r.first_step for r in rr), default=None),
                    "last_step": max((r.last_step for r in rr), default=None),
                    "last_seen_at": max((r.last_seen_at for r in rr), default=None),
                    "layer_count": run.layer_count,
                    "ranks": [r.rank for r in rr],
                    "points": sum(r.points for r in rr),
                    "metrics": k["layer"],
                    "scalars": k["scalar"],
                }
            )
        return out

    def list_runs(self) -> list[dict[str, Any]]:
        """Summaries of every run, by name."""
        with self.factory() as session:
            runs = session.execute(select(Run).order_by(Run.name)).scalars().all()
            return self._summaries(session, runs)

    def get_run(self, name: str) -> dict[str, Any]:
        """Summary of one run (raises NotFoundError)."""
        with self.factory() as session:
            return self._summaries(session, [self._run(session, name)])[0]

    def run_id(self, name: str) -> int:
        """The database id of run ``name`` (raises NotFoundError)."""
        with self.factory() as session:
            return self._run(session, name).id

    def list_layers(self, name: str) -> list[dict[str, Any]]:
        """Layers of a run in model order."""
        with self.factory() as session:
            run = self._run(session, name)
            rows = session.execute(select(Layer.idx, Layer.name).where(Layer.run_id == run.id).order_by(Layer.idx))
            return [{"index": int(i), "name": n} for i, n in rows]

    def delete_run(self, name: str) -> None:
        """Delete a run and everything stored for it (foreign keys cascade)."""
        with self.factory() as session:
            session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            run = self._run(session, name)
            session.execute(delete(Run).where(Run.id == run.id))
            session.commit()
        with self._lock:
            self._runs.pop(run.id, None)

    # ---------------------------------------------------------------- series and heatmaps
    def _name_id(self, session: Session, run_id: int, name: str, kind: str) -> int:
        row = session.execute(
            select(MetricName.id)
            .join(RunMetric, and_(RunMetric.name_id == MetricName.id, RunMetric.run_id == run_id))
            .where(MetricName.name == name, RunMetric.kind == kind)
        ).first()
        if row is None:
            what = "metric" if kind == "layer" else "scalar"
            raise NotFoundError(f"{what} {name!r} not found in this run")
        return int(row[0])

    def _range(
        self, session: Session, run_id: int, rank: int, start: int | None, end: int | None
    ) -> tuple[int, int] | None:
        rr = session.get(RunRank, (run_id, rank))
        if rr is None:
            return None
        lo = rr.first_step if start is None else start
        hi = rr.last_step if end is None else end
        return (lo, hi) if lo <= hi else None

    def _raw_partials(
        self, conn: Connection, run_id: int, rank: int, nid: int, lo: int, hi: int, layer: int | None, n_layers: int
    ) -> tuple[I64, Partials]:
        width = 1 if layer is not None else n_layers
        if lo > hi:
            return np.zeros(0, dtype=np.int64), Partials.empty(0, width)
        params = {"run_id": run_id, "rank": rank, "nid": nid, "lo": lo, "hi": hi}
        if layer is None:
            rows = conn.execute(self._raw_rows, params).all()
        else:
            rows = conn.execute(self._raw_layer_rows, {**params, "offset": 4 * layer + 1}).all()
        steps, blobs = _columns(rows)
        return steps, Partials.from_values(rows_from_blobs(blobs, width))

    def _rollup_partials(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        nid: int,
        level: int,
        lo_b: int,
        hi_b: int,
        layer: int | None,
        n_layers: int,
    ) -> tuple[I64, Partials]:
        params = {"run_id": run_id, "rank": rank, "nid": nid, "level": level, "lo": lo_b, "hi": hi_b}
        if layer is None:
            rows = conn.execute(self._block_rows, params).all()
        else:
            offset = STATS_DTYPE.itemsize * layer + 1
            rows = conn.execute(self._block_layer_rows, {**params, "offset": offset}).all()
        buckets, blobs = _columns(rows)
        width = 1 if layer is not None else n_layers
        return buckets * level, Partials.from_stats(blobs, width)

    def _bucketed(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        nid: int,
        lo: int,
        hi: int,
        width: int,
        layer: int | None,
        n_layers: int,
    ) -> tuple[I64, Partials]:
        """Partials per aligned bucket of ``width`` steps over [lo, hi]; keys are bucket indexes (step // width)."""
        levels = [lv for lv in LEVELS if lv <= width]
        if not levels:
            steps, part = self._raw_partials(conn, run_id, rank, nid, lo, hi, layer, n_layers)
            keys, starts = group_starts(steps // width)
            return keys, part.reduce(starts) if keys.size else part
        level = levels[-1]
        first_full = -(-lo // level)
        last_full = (hi + 1) // level - 1
        if first_full > last_full:
            steps, part = self._raw_partials(conn, run_id, rank, nid, lo, hi, layer, n_layers)
        else:
            h_steps, head = self._raw_partials(conn, run_id, rank, nid, lo, first_full * level - 1, layer, n_layers)
            m_steps, mid = self._rollup_partials(conn, run_id, rank, nid, level, first_full, last_full, layer, n_layers)
            t_steps, tail = self._raw_partials(conn, run_id, rank, nid, (last_full + 1) * level, hi, layer, n_layers)
            steps = np.concatenate([h_steps, m_steps, t_steps])
            part = Partials(
                np.concatenate([head.vmin, mid.vmin, tail.vmin]),
                np.concatenate([head.vmax, mid.vmax, tail.vmax]),
                np.concatenate([head.vsum, mid.vsum, tail.vsum]),
                np.concatenate([head.vcount, mid.vcount, tail.vcount]),
            )
        keys, starts = group_starts(steps // width)
        return keys, part.reduce(starts) if keys.size else part

    def series(
        self, run: str, metric: str, layer: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> dict[str, Any]:
        """min/mean/max of one layer's metric over [start, end]: exact when the range holds ≤ max_points samples."""
        with self.engine.connect() as conn:
            keys_row = conn.execute(
                self._series_keys, {"run": run, "layer": layer, "metric": metric, "rank": rank}
            ).first()
            if keys_row is None:
                raise NotFoundError(f"run {run!r} not found")
            run_id, n_layers, idx, nid, first_step, last_step = keys_row
            if idx is None:
                raise NotFoundError(f"layer {layer!r} not found in run {run!r}")
            if nid is None:
                raise NotFoundError(f"metric {metric!r} not found in this run")
            lo = first_step if start is None else start
            hi = last_step if end is None else end
            if first_step is None or lo > hi:
                return {"steps": [], "min": [], "mean": [], "max": [], "bucket_steps": 1}
            width = 1
            if hi - lo + 1 > max_points:
                # Only whether the range holds more than max_points samples matters: count at most max_points + 1.
                params = {"run_id": run_id, "rank": rank, "nid": nid, "lo": lo, "hi": hi, "limit": max_points + 1}
                if conn.execute(self._raw_count, params).scalar_one() > max_points:
                    width = choose_width(lo, hi, max_points)
            keys, part = self._bucketed(conn, run_id, rank, nid, lo, hi, width, int(idx), int(n_layers))
        return self._series_answer(
            keys, width, lo, part.vmin[:, 0], part.vmax[:, 0], part.mean()[:, 0], part.vcount[:, 0]
        )

    @staticmethod
    def _series_answer(
        keys: I64, width: int, lo: int, vmin: np.ndarray, vmax: np.ndarray, mean: np.ndarray, count: np.ndarray
    ) -> dict[str, Any]:
        keep = count > 0
        steps = np.maximum(keys * width, lo)[keep]
        return {
            "steps": steps,
            "min": to_json_floats(vmin[keep]),
            # Exact answers (one sample per bucket) give the stored value itself, so min = mean = max also in JSON.
            "mean": to_json_floats(vmin[keep] if width == 1 else mean[keep]),
            "max": to_json_floats(vmax[keep]),
            "bucket_steps": width,
        }

    def scalar_series(
        self, run: str, scalar: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> dict[str, Any]:
        """The same as :meth:`series` for a per-run scalar (float64, from raw rows)."""
        with self.factory() as session:
            r = self._run(session, run)
            nid = self._name_id(session, r.id, scalar, "scalar")
            rng = self._range(session, r.id, rank, start, end)
            if rng is None:
                return {"steps": [], "min": [], "mean": [], "max": [], "bucket_steps": 1}
            lo, hi = rng
            rows = session.execute(
                select(ScalarPoint.step, ScalarPoint.value)
                .where(
                    ScalarPoint.run_id == r.id,
                    ScalarPoint.rank == rank,
                    ScalarPoint.name_id == nid,
                    ScalarPoint.step >= lo,
                    ScalarPoint.step <= hi,
                )
                .order_by(ScalarPoint.step)
            ).all()
        steps = np.array([row[0] for row in rows], dtype=np.int64)
        values = np.frombuffer(b"".join(bytes(row[1]) for row in rows), dtype="<f8").astype(np.float64)
        width = 1 if steps.size <= max_points else choose_width(lo, hi, max_points)
        keys, starts = group_starts(steps // width)
        if not keys.size:
            return {"steps": [], "min": [], "mean": [], "max": [], "bucket_steps": width}
        counts = np.diff(np.append(starts, steps.size))
        return self._series_answer(
            keys,
            width,
            lo,
            np.minimum.reduceat(values, starts),
            np.maximum.reduceat(values, starts),
            np.add.reduceat(values, starts) / counts,
            counts,
        )

    def heatmap(
        self,
        run: str,
        metric: str,
        rank: int,
        start: int | None,
        end: int | None,
        max_steps: int,
        layers: str | None,
        agg: str,
    ) -> dict[str, Any]:
        """Layers (model order) × aligned step buckets of ``metric``, aggregated by ``agg`` (max, mean or min)."""
        with self.factory() as session:
            r = self._run(session, run)
            nid = self._name_id(session, r.id, metric, "layer")
            names = [n for (n,) in session.execute(select(Layer.name).where(Layer.run_id == r.id).order_by(Layer.idx))]
            chosen = [i for i, n in enumerate(names) if layers is None or fnmatch.fnmatchcase(n, layers)]
            rng = self._range(session, r.id, rank, start, end)
            if rng is None or not chosen:
                return {
                    "layers": [names[i] for i in chosen],
                    "steps": [],
                    "values": [[] for _ in chosen],
                    "bucket_steps": 1,
                }
            lo, hi = rng
            width = choose_width(lo, hi, max_steps)
            keys, part = self._bucketed(session.connection(), r.id, rank, nid, lo, hi, width, None, r.layer_count)
        grid = np.arange(lo // width, hi // width + 1, dtype=np.int64)
        pos = np.searchsorted(grid, keys)
        n_cols = grid.size
        sel: slice | I64 = slice(None) if len(chosen) == len(names) else np.array(chosen, dtype=np.int64)
        data: np.ndarray
        if agg == "mean" and width > 1:
            data = part.mean()[:, sel]
        elif agg == "min":
            data = part.vmin[:, sel]
        else:
            data = part.vmax[:, sel]
        full: np.ndarray
        if keys.size == n_cols:
            full, valid = data, part.vcount[:, sel] > 0
        else:
            full = np.full((n_cols, len(chosen)), np.nan)
            valid = np.zeros((n_cols, len(chosen)), dtype=bool)
            full[pos] = data
            valid[pos] = part.vcount[:, sel] > 0
        return {
            "layers": [names[i] for i in chosen],
            "steps": np.maximum(grid * width, lo),
            "values": to_json_matrix(full.T, valid.T),
            "bucket_steps": width,
        }

    # ---------------------------------------------------------------- export
    def _export_rows(self, run: str, chunk_rows: int = 256) -> Iterator[tuple[list[Any], ...]]:
        """Yield column chunks (rank, step, time, kind, name, layer, value) of every stored point, exact values."""
        with self.factory() as session:
            r = self._run(session, run)
            layers = [n for (n,) in session.execute(select(Layer.name).where(Layer.run_id == r.id).order_by(Layer.idx))]
            names = dict(session.execute(select(MetricName.id, MetricName.name)).all())
            layer_arr = np.array(layers, dtype=object)
            result = session.execute(
                select(Point.rank, Point.step, Point.time, Point.name_id, Point.vals)
                .where(Point.run_id == r.id)
                .order_by(Point.rank, Point.step, Point.name_id)
                .execution_options(yield_per=chunk_rows)
            )
            for part in result.partitions():
                cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
                for rank, step, tm, nid, vals in part:
                    values = rows_from_blobs([bytes(vals)], len(layers))[0]
                    keep = ~is_missing(values)
                    k = int(keep.sum())
                    cols[0].extend([rank] * k)
                    cols[1].extend([step] * k)
                    cols[2].extend([tm] * k)
                    cols[3].extend(["metric"] * k)
                    cols[4].extend([names[nid]] * k)
                    cols[5].extend(layer_arr[keep].tolist())
                    cols[6].extend(values[keep].tolist())
                yield cols
            scal = session.execute(
                select(ScalarPoint.rank, ScalarPoint.step, ScalarPoint.time, ScalarPoint.name_id, ScalarPoint.value)
                .where(ScalarPoint.run_id == r.id)
                .order_by(ScalarPoint.rank, ScalarPoint.step, ScalarPoint.name_id)
                .execution_options(yield_per=chunk_rows * 64)
            )
            for part in scal.partitions():
                cols = ([], [], [], [], [], [], [])
                for rank, step, tm, nid, value in part:
                    cols[0].append(rank)
                    cols[1].append(step)
                    cols[2].append(tm)
                    cols[3].append("scalar")
                    cols[4].append(names[nid])
                    cols[5].append(None)
                    cols[6].append(struct.unpack("<d", value)[0])
                yield cols

    EXPORT_COLUMNS = ("rank", "step", "time", "kind", "name", "layer", "value")

    def export_csv(self, run: str) -> Iterator[bytes]:
        """CSV of every stored point (header first); float32 values printed exactly (round-trip)."""
        self.run_id(run)
        return self._csv(run)

    def _csv(self, run: str) -> Iterator[bytes]:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.EXPORT_COLUMNS)
        for cols in self._export_rows(run):
            writer.writerows(
                (
                    rank,
                    step,
                    "" if tm is None else repr(tm),
                    kind,
                    name,
                    layer or "",
                    _json_value(v) if not math.isfinite(v) else repr(v),
                )
                for rank, step, tm, kind, name, layer, v in zip(*cols, strict=True)
            )
            yield buf.getvalue().encode()
            buf.seek(0)
            buf.truncate()
        if buf.tell():
            yield buf.getvalue().encode()

    def export_parquet(self, run: str) -> Iterator[bytes]:
        """Parquet of every stored point, written and streamed one row group per chunk (needs pyarrow)."""
        import pyarrow as pa  # optional dependency: the `parquet` extra
        import pyarrow.parquet as pq

        self.run_id(run)
        schema = pa.schema(
            [
                ("rank", pa.int32()),
                ("step", pa.int64()),
                ("time", pa.float64()),
                ("kind", pa.string()),
                ("name", pa.string()),
                ("layer", pa.string()),
                ("value", pa.float64()),
            ]
        )

        def generate() -> Iterator[bytes]:
            sink = _Sink()
            writer = pq.ParquetWriter(sink, schema)
            for cols in _merge_chunks(self._export_rows(run), 1 << 16):
                writer.write_table(pa.table(dict(zip(self.EXPORT_COLUMNS, cols, strict=True)), schema=schema))
                yield sink.take()
            writer.close()
            yield sink.take()

        return generate()


class _Sink(io.RawIOBase):
    """A write-only file collecting bytes until taken (for streaming a Parquet writer's output)."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._parts.append(chunk)
        self._pos += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def _merge_chunks(chunks: Iterable[tuple[list[Any], ...]], rows: int) -> Iterator[tuple[list[Any], ...]]:
    acc: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
    for cols in chunks:
        for a, c in zip(acc, cols, strict=True):
            a.extend(c)
        if len(acc[0]) >= rows:
            yield acc
            acc = ([], [], [], [], [], [], [])
    if acc[0]:
        yield acc
