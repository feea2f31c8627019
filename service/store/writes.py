"""The ingest path: a batch stored atomically (points, rollups, bookkeeping), or recognised as a duplicate.

Writers of one (run, rank) are serialised (SQLite: one writer at a time; PostgreSQL: a transaction-scoped advisory
lock), which makes read-merge-write of rollups and last-write-wins merges of re-sent points safe with several
collector replicas on one database.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    and_,
    bindparam,
    cast,
    delete,
    func,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.batch import IngestBatch, IngestObserver, StoredRun
from quantwatch.service.core.driver_sql import DriverStatement, driver_upserts
from quantwatch.service.models import (
    Batch,
    EstimatedPoint,
    Layer,
    MetricName,
    Point,
    Run,
    RunMetric,
    RunRank,
    ScalarPoint,
)
from quantwatch.service.rollups import F32, I64, MISSING_BITS, is_missing, missing_row
from quantwatch.service.store.actions import write_actions
from quantwatch.service.store.common import IngestResult, RunCache, find_run
from quantwatch.service.store.compaction import Compactor, compaction_due, edge_steps
from quantwatch.service.store.group_commit import GroupCommit
from quantwatch.service.store.raw_points import RawPoints, Rows
from quantwatch.service.store.retention import keep_retained
from quantwatch.service.store.rollup_writes import RollupWriter

log = logging.getLogger("quantwatch.service")


@dataclass(frozen=True)
class _Stored:
    """What a stored batch publishes to the writer's caches once committed, the rank's frontier it read and the
    spacing of the edges it compacts the rank to."""

    run_id: int
    frontier: int
    edge: int
    names: dict[str, int]
    cache: RunCache


RUN_LOCK_TAG = 1 << 40
RANK_LOCK_SPAN = 1 << 20

# The statements every batch runs, built once and run as driver SQL compiled once (DriverStatement): building,
# cache-keying and executing a Core statement costs SQLAlchemy more than the driver spends on its SQL.
# A run's row with its rank's frontier and newest step (NULL: a rank with nothing stored yet), in one statement: on
# SQLite by name (the transaction holds the write lock from its start), on PostgreSQL by id under the rank's lock.
_OF_RANK = and_(RunRank.run_id == Run.id, RunRank.rank == bindparam("rank"))
_MARKS = (Run.layer_count, RunRank.compacted_step, RunRank.last_step)
_RUN = DriverStatement(select(Run.id, *_MARKS).outerjoin(RunRank, _OF_RANK).where(Run.name == bindparam("name")))
_LOCKED_MARKS = select(*_MARKS).outerjoin(RunRank, _OF_RANK).where(Run.id == bindparam("run_id"))
_BATCH_FIELDS = ("run_id", "batch_id", "rank", "received_at", "points")
_RANK_FIELDS = ("run_id", "rank", "first_step", "last_step", "last_seen_at", "points")
_STORED_STEPS = select(Point.step, Point.name_id).where(
    Point.run_id == bindparam("run_id"),
    Point.rank == bindparam("rank"),
    Point.step >= bindparam("lo"),
    Point.step <= bindparam("hi"),
)


class BatchWriter:
    """The ingest path of one engine; holds small caches of immutable facts (name ids, layer order) per process."""

    def __init__(self, engine: Engine, factory: sessionmaker[Session], *, fold_chunks: bool = True) -> None:
        self.factory = factory
        self.pg = engine.dialect.name == "postgresql"
        self._insert = postgresql.insert if self.pg else sqlite.insert
        self._points = RawPoints()
        self._rollups = RollupWriter(self._insert, self._points)
        batch_row = self._insert(Batch).on_conflict_do_nothing()
        # On PostgreSQL the statement that inserts the batch's row also takes its rank's write lock (a RETURNING
        # expression runs only for a row inserted: a duplicate takes no lock), one round trip per batch fewer.
        self._batch_insert = DriverStatement(
            batch_row.returning(Batch.batch_id, func.pg_advisory_xact_lock(bindparam("rank_key", type_=BigInteger)))
            if self.pg
            else batch_row.returning(Batch.batch_id),
            _BATCH_FIELDS,
        )
        # On PostgreSQL the run's id is looked up by name inside that statement (the lock's key computed from it as
        # rank_key does), so a batch of a known run needs no statement of its own to find its run first: the marks
        # that lookup read are read again under the lock anyway.
        # The lock key's span is written into the SQL (a value bound into a statement is not a DriverStatement's).
        span = literal_column(str(RANK_LOCK_SPAN), BigInteger)
        self._batch_insert_by_name = DriverStatement(
            postgresql.insert(Batch)
            .from_select(
                ["run_id", "batch_id", "rank", "received_at", "points"],
                select(
                    Run.id,
                    bindparam("batch_id"),
                    bindparam("rank"),
                    bindparam("received_at"),
                    bindparam("points", type_=BigInteger),
                ).where(Run.name == bindparam("name")),
            )
            .on_conflict_do_nothing()
            .returning(
                Batch.run_id,
                func.pg_advisory_xact_lock(
                    cast(Batch.run_id, BigInteger) * span + bindparam("rank_part", type_=BigInteger)
                ),
            )
        )
        dialect = engine.dialect.name
        step_key = ("run_id", "rank", "name_id", "step")  # one step of one series: the key of each row below
        self._point_upsert = driver_upserts(Point, step_key, ("vals", "time"))[dialect]
        rank = self._insert(RunRank)
        least, greatest = (func.least, func.greatest) if self.pg else (func.min, func.max)
        table = RunRank.__table__
        # Built once, as the point upsert: building and cache-keying it per batch cost ~a fifth of a 1-step batch.
        rank_set = {
            "first_step": least(table.c.first_step, rank.excluded.first_step),
            "last_step": greatest(table.c.last_step, rank.excluded.last_step),
            "last_seen_at": rank.excluded.last_seen_at,
            "points": table.c.points + rank.excluded.points,
        }
        self._rank_upsert = DriverStatement(
            rank.on_conflict_do_update(index_elements=["run_id", "rank"], set_=rank_set), _RANK_FIELDS
        )
        # On PostgreSQL, once the batch holds its rank's lock, one statement reads the run's layer count and the
        # rank's marks as they were before the batch and upserts the rank's row for it: the upsert runs in a CTE of
        # the read, and both see the statement's snapshot, taken after the lock.
        ranked = rank.values({name: bindparam(name) for name in _RANK_FIELDS})
        self._marks_and_rank = DriverStatement(
            select(_LOCKED_MARKS.cte("marks")).add_cte(
                ranked.on_conflict_do_update(index_elements=["run_id", "rank"], set_=rank_set).cte("rank_row")
            )
        )
        self._scalar_upsert = driver_upserts(ScalarPoint, step_key, ("value", "time"))[dialect]
        self._estimated_insert = driver_upserts(EstimatedPoint, step_key)[dialect]
        self._names: dict[str, int] = {}
        self._runs: dict[int, RunCache] = {}
        self._lock = threading.Lock()
        # SQLite has one writer at a time: this process's batches share transactions (PostgreSQL runs them side by
        # side, each under its rank's advisory lock).
        self._group = None if self.pg else GroupCommit(factory)
        self._compactor = Compactor(factory, self._rollups, self.pg, self._group, fold=fold_chunks)

    def ingest(self, batch: IngestBatch, observers: Sequence[IngestObserver] = ()) -> IngestResult:
        """Store ``batch`` atomically, or recognise it as a duplicate; run the observers (see IngestObserver)."""
        now = time.time()
        if self._group is not None:
            stored = self._group.run(lambda session: self._store(session, batch, observers, now))
        else:
            with self.factory() as session:
                try:
                    session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
                    stored = self._store(session, batch, observers, now)
                    if stored is None:
                        session.rollback()
                    else:
                        session.commit()
                except BaseException:
                    session.rollback()
                    raise
        if stored is None:
            return IngestResult(batch.batch_id, True, 0)
        with self._lock:
            self._names.update(stored.names)
            self._runs[stored.run_id] = stored.cache
        for observer in observers:
            try:
                observer.after_commit(batch)
            except Exception:
                log.exception("ingest observer %r failed after commit", observer)
        if compaction_due(stored.frontier, batch.step_numbers[-1], stored.edge):
            self._compact(stored.run_id, batch.rank, stored.edge)
        return IngestResult(batch.batch_id, False, batch.points)

    def _store(
        self, session: Session, batch: IngestBatch, observers: Sequence[IngestObserver], now: float
    ) -> _Stored | None:
        """Write ``batch`` in ``session``'s transaction (or savepoint) and run the observers' ``on_batch``; what to
        publish once it is committed, or None for a duplicate (nothing written)."""
        pending_names: dict[str, int] = {}
        conn = session.connection()
        row: dict[str, Any] = {
            "batch_id": batch.batch_id,
            "rank": batch.rank,
            "received_at": now,
            "points": batch.points,
        }
        found = None
        if self.pg:
            by_name = {**row, "name": batch.run, "rank_part": self._rank_part(batch.rank)}
            found = self._batch_insert_by_name.execute(conn, by_name).first()
        if found is not None:
            run_id = int(found[0])
        else:
            # SQLite; or on PostgreSQL a new run, or a duplicate (nothing inserted by name): the statements one by one.
            run_id, marks = self._ensure_run(conn, batch.run, batch.rank, now)
            row["run_id"] = run_id
            if self.pg:
                row["rank_key"] = self.rank_key(run_id, batch.rank)
            if self._batch_insert.execute(conn, row).first() is None:
                return None
        if self.pg:
            # Holding the rank lock now, read the layer count and the marks again, in a statement of their own (its
            # snapshot is taken after the lock): a transaction of this rank that committed while we waited may have
            # widened the run, and its rollup blobs with it. The same statement upserts the rank's row for the batch.
            marks = tuple(self._marks_and_rank.execute(conn, self._rank_row(run_id, batch, now)).one())
        layer_count = int(marks[0])
        frontier, last_step = (0, -1) if marks[1] is None else (int(marks[1]), int(marks[2]))
        cache = self._run_cache(conn, run_id, layer_count)
        layers, index = self._ensure_layers(conn, run_id, cache, batch.layers)
        names = {n for s in batch.steps for n in s.metrics} | {n for s in batch.steps for n in s.scalars}
        name_ids = self._name_ids(conn, sorted(names), pending_names)
        self._write_run_metrics(conn, run_id, batch, name_ids, cache)
        self._write_points(conn, run_id, batch, layers, index, name_ids, frontier, last_step)
        self._write_scalars(conn, run_id, batch, name_ids)
        self._write_estimated(conn, run_id, batch, name_ids)
        write_actions(conn, self._insert, run_id, batch, now)
        if not self.pg:
            self._rank_upsert.execute(conn, self._rank_row(run_id, batch, now))
        run_row = StoredRun(run_id, batch.run)
        for observer in observers:
            observer.on_batch(session, run_row, batch)
        kinds = cache.kinds | self._new_kinds(batch, name_ids)
        edge = edge_steps(batch.step_numbers, last_step)
        return _Stored(run_id, frontier, edge, pending_names, RunCache(layers, index, kinds))

    def compact_all(self, run: str) -> None:
        """Move every rank's frontier of ``run`` past its last step now (see Store.compact_rollups; raises
        NotFoundError); ingest keeps the blocks current from then on."""
        with self.factory() as session:
            run_id = find_run(session, run).id
            ranks = session.scalars(select(RunRank.rank).where(RunRank.run_id == run_id)).all()
        for rank in ranks:
            with self._exclusive():
                self._compactor.compact(run_id, rank, self.rank_key(run_id, rank), whole=True)
            if self._compactor.folds is not None:
                self._compactor.folds.fold(run_id, rank, self.rank_key(run_id, rank))

    def compact_idle(self, seen_before: float) -> int:
        """Compact the ranks whose complete blocks wait behind no compaction edge and whose last batch came before
        ``seen_before`` (see Compactor.compact_idle); how many it compacted."""
        return self._compactor.compact_idle(seen_before, self.rank_key, self._exclusive)

    def _exclusive(self) -> AbstractContextManager[None]:
        """The write slot between ingest groups on SQLite (see GroupCommit); nothing to hold on PostgreSQL."""
        return self._group.exclusive() if self._group is not None else nullcontext()

    def _compact(self, run_id: int, rank: int, edge: int) -> None:
        """Build the rank's complete blocks after the batch is durable: a failure here costs reads some raw steps
        until the rank's next batch retries it, never the acknowledged batch (so it is logged, not raised)."""
        try:
            with self._exclusive():
                self._compactor.compact(run_id, rank, self.rank_key(run_id, rank), edge)
        except Exception:
            log.exception("rollup compaction of run id %d rank %d failed; the next batch retries it", run_id, rank)

    @staticmethod
    def rank_key(run_id: int, rank: int) -> int:
        return run_id * RANK_LOCK_SPAN + BatchWriter._rank_part(rank)

    @staticmethod
    def _rank_part(rank: int) -> int:
        """The rank's share of its lock key (see rank_key), below RANK_LOCK_SPAN."""
        return rank % (RANK_LOCK_SPAN - 1) + 1

    @staticmethod
    def _new_kinds(batch: IngestBatch, name_ids: dict[str, int]) -> set[tuple[int, str]]:
        kinds = {(name_ids[n], "layer") for s in batch.steps for n in s.metrics}
        return kinds | {(name_ids[n], "scalar") for s in batch.steps for n in s.scalars}

    def _ensure_run(self, conn: Connection, name: str, rank: int, now: float) -> tuple[int, Sequence[Any]]:
        """The run's id (created when new) and its layer count and rank's marks (see ``_RUN``)."""
        row = _RUN.execute(conn, {"name": name, "rank": rank}).first()
        if row is None:
            conn.execute(self._insert(Run).values(name=name, created_at=now, layer_count=0).on_conflict_do_nothing())
            row = _RUN.execute(conn, {"name": name, "rank": rank}).one()
        return int(row[0]), tuple(row[1:])

    def _run_cache(self, conn: Connection, run_id: int, layer_count: int) -> RunCache:
        cached = self._runs.get(run_id)
        if cached is not None and len(cached.layers) == layer_count:
            return cached  # shared, never changed: a batch that adds layers or kinds publishes new ones
        layers = [r[0] for r in conn.execute(select(Layer.name).where(Layer.run_id == run_id).order_by(Layer.idx))]
        kinds = {
            (int(r[0]), str(r[1]))
            for r in conn.execute(select(RunMetric.name_id, RunMetric.kind).where(RunMetric.run_id == run_id))
        }
        return RunCache(layers, {n: i for i, n in enumerate(layers)}, kinds)

    def _ensure_layers(
        self, conn: Connection, run_id: int, cache: RunCache, names: Sequence[str]
    ) -> tuple[list[str], dict[str, int]]:
        if list(names) == cache.layers or all(n in cache.index for n in names):  # the first test: most batches
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
        self, conn: Connection, run_id: int, batch: IngestBatch, name_ids: dict[str, int], cache: RunCache
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
        frontier: int,
        last_step: int,
    ) -> None:
        n_layers = len(layers)
        identity = list(batch.layers) == layers  # the run's layers in its order: most batches
        columns = np.arange(n_layers) if identity else np.array([index[n] for n in batch.layers], dtype=np.int64)
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
        steps_by_metric = keep_retained(conn, run_id, batch.rank, steps_by_metric, frontier)
        if not steps_by_metric:
            return
        lo, hi = batch.step_numbers[0], batch.step_numbers[-1]
        # Chunks hold only steps behind the frontier: a batch wholly past it (the usual case) looks at raw rows only.
        stored: dict[int, Rows] = {}
        if lo < frontier:
            nids = [name_ids[name] for name in steps_by_metric]
            stored = self._points.read_many(conn, run_id, batch.rank, nids, lo, hi, n_layers)
            existing = {(int(s), nid) for nid, found in stored.items() for s in found.steps.tolist()}
        elif lo <= last_step:  # a batch wholly past the rank's newest step (the usual case) re-sends nothing
            existing = {
                (int(r[0]), int(r[1]))
                for r in conn.execute(_STORED_STEPS, {"run_id": run_id, "rank": batch.rank, "lo": lo, "hi": hi})
            }
        else:
            existing = set()
        rows: list[dict[str, Any]] = []
        matrices: dict[int, tuple[I64, F32]] = {}
        for name, entries in steps_by_metric.items():
            nid = name_ids[name]
            steps = np.array([e[0] for e in entries], dtype=np.int64)
            values = np.stack([e[2] for e in entries])
            hits = [i for i, s in enumerate(steps.tolist()) if (s, nid) in existing]
            if hits:
                found = stored.get(nid)
                if found is None:  # past the frontier: RawPoints reads the raw rows only
                    key = {"run_id": run_id, "rank": batch.rank, "nid": nid}
                    lo_hit, hi_hit = int(steps[hits].min()), int(steps[hits].max())
                    found = self._points.read(conn, key, lo_hit, hi_hit, frontier, n_layers)
                old = found.values[np.searchsorted(found.steps, steps[hits])]
                new = values[hits]
                # Last write wins per (layer, step): a re-sent step replaces what it measures, keeps the rest.
                values[hits] = np.where(is_missing(new), old, new)
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
        self._point_upsert.execute(conn, rows)
        # Steps at or past the frontier wait for the compactor; a step behind it (late, or re-sent) lands in a
        # complete block, which is recomputed from the raw points just written (a min or max cannot be subtracted).
        late = {nid: (s[s < frontier], v[s < frontier]) for nid, (s, v) in matrices.items() if int(s[0]) < frontier}
        if late:
            self._rollups.write(conn, run_id, batch.rank, late, set(late), n_layers, frontier)

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
            self._scalar_upsert.execute(conn, rows)

    def _write_estimated(self, conn: Connection, run_id: int, batch: IngestBatch, name_ids: dict[str, int]) -> None:
        # A step re-sent as exact keeps its mark: the agent re-sends a step only as it was (a retry).
        rows = [
            {"run_id": run_id, "rank": batch.rank, "name_id": name_ids[name], "step": st.step}
            for st in batch.steps
            for name in sorted(st.estimated)
        ]
        if rows:
            self._estimated_insert.execute(conn, rows)

    @staticmethod
    def _rank_row(run_id: int, batch: IngestBatch, now: float) -> dict[str, Any]:
        """The rank's row as the batch upserts it (see ``_rank_upsert``)."""
        return {
            "run_id": run_id,
            "rank": batch.rank,
            "first_step": batch.step_numbers[0],
            "last_step": batch.step_numbers[-1],
            "last_seen_at": now,
            "points": batch.points,
        }

    def delete_run(self, name: str) -> None:
        """Delete a run and everything stored for it (foreign keys cascade)."""
        with self._exclusive(), self.factory() as session:
            session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            run = find_run(session, name)
            session.execute(delete(Run).where(Run.id == run.id))
            session.commit()
        with self._lock:
            self._runs.pop(run.id, None)
