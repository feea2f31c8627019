"""History reads: run summaries, layers, series (min/mean/max over aligned buckets), layer × step heatmaps and one
step's layers × ranks."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Integer,
    Select,
    and_,
    bindparam,
    case,
    func,
    select,
)
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from quantwatch.service.models import (
    EstimatedPoint,
    Layer,
    MetricName,
    Point,
    Rollup,
    Run,
    RunMetric,
    RunRank,
    ScalarPoint,
)
from quantwatch.service.rollup_codec import GROUP_LAYERS, HEADER_SIZE, decode_blocks, decode_layer
from quantwatch.service.rollups import (
    I64,
    LEVELS,
    Partials,
    group_starts,
    is_missing,
    missing_row,
    to_json_floats,
    to_json_matrix,
)
from quantwatch.service.store.common import NotFoundError, choose_width, columns, find_run
from quantwatch.service.store.raw_points import RawPoints
from quantwatch.service.store.rollup_writes import read_raw_from


def _one_series(
    table: type[Point | Rollup | EstimatedPoint], position: InstrumentedAttribute[int]
) -> tuple[ColumnElement[bool], ...]:
    """The rows of one (run, rank, name) series of ``table`` whose ``position`` (step or bucket) is in [lo, hi]."""
    return (
        table.run_id == bindparam("run_id"),
        table.rank == bindparam("rank"),
        table.name_id == bindparam("nid"),
        position >= bindparam("lo"),
        position <= bindparam("hi"),
    )


def retained_width(width: int, dropped: bool) -> int:
    """The bucket width of a read asking for ``width``: at least the base rollup level where its range reaches steps
    whose raw points retention dropped (``dropped``), as that is the finest resolution stored there."""
    return max(width, LEVELS[0]) if dropped else width


def _le32(data: ColumnElement[bytes], at: ColumnElement[int] | int) -> ColumnElement[int]:
    """The little-endian uint32 at byte ``at`` (from 0) of a bytea (PostgreSQL), as an integer: an offset within a
    block or a layer count, far below 2**31 (above, PostgreSQL raises an integer overflow)."""
    total: ColumnElement[int] = func.get_byte(data, at)
    for k in (1, 2, 3):
        total = total + func.get_byte(data, at + k) * (256**k)
    return total


def _layer_group_rows(blocks: tuple[ColumnElement[bool], ...]) -> Select[Any]:
    """(bucket, head, group) of the blocks ``blocks`` selects, the group the one of bind parameter ``layer`` (the
    ``g``-th) picked out of each block in SQL from the offset table in the head (the first ``head_len`` bytes: as
    far as the group's end; NULL where the block holds fewer layers), so that a one-layer read of PostgreSQL fetches
    ~600 bytes of a block of 512 layers rather than ~4,500. The head is fetched once in a subquery fenced by OFFSET 0
    (a flattened one would fetch it from the TOAST table for every get_byte)."""
    head = func.substring(Rollup.stats, 1, bindparam("head_len")).label("head")
    inner = select(Rollup.bucket, Rollup.stats, head).where(*blocks).offset(0).subquery()
    held = _le32(inner.c.head, 3)
    table = HEADER_SIZE + 4 * ((held + GROUP_LAYERS - 1) // GROUP_LAYERS)
    end_at: ColumnElement[int] = HEADER_SIZE + 4 * bindparam("g", type_=Integer)
    start = case((bindparam("g") == 0, 0), else_=_le32(inner.c.head, end_at - 4))
    group = func.substring(inner.c.stats, table + start + 1, _le32(inner.c.head, end_at) - start)
    return select(inner.c.bucket, inner.c.head, case((held > bindparam("layer"), group))).order_by(inner.c.bucket)


MAX_GAP_READS = 8
"""Runs of unstored rollup blocks a bucketed read fetches one by one from the raw points; more: one read over all."""


class HistoryReader:
    """The read side of one engine, with its statements prebuilt."""

    def __init__(self, engine: Engine, factory: sessionmaker[Session]) -> None:
        self.engine = engine
        self.factory = factory
        self._build_read_statements()

    def _build_read_statements(self) -> None:
        """Prebuilt statements of the history reads (a series answer runs four of them; building each per call cost
        more than executing it)."""
        self._points = RawPoints()
        blocks = (*_one_series(Rollup, Rollup.bucket), Rollup.level == bindparam("level"))
        self._block_rows = select(Rollup.bucket, Rollup.stats).where(*blocks).order_by(Rollup.bucket)
        self._layer_group_rows = _layer_group_rows(blocks) if self.engine.dialect.name == "postgresql" else None
        self._estimated_steps = select(EstimatedPoint.step).where(*_one_series(EstimatedPoint, EstimatedPoint.step))
        # Everything a series read needs to know before reading values, in one round trip: the run, the layer's
        # index, the metric's id (only if the run has sent it) and the rank's step range (NULL where absent).
        self._series_keys = (
            select(
                Run.id,
                Run.layer_count,
                Layer.idx,
                RunMetric.name_id,
                RunRank.first_step,
                RunRank.last_step,
                RunRank.compacted_step,
                RunRank.raw_from_step,
            )
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
            return self._summaries(session, [find_run(session, name)])[0]

    def run_id(self, name: str) -> int:
        """The database id of run ``name`` (raises NotFoundError)."""
        with self.factory() as session:
            return find_run(session, name).id

    def list_layers(self, name: str) -> list[dict[str, Any]]:
        """Layers of a run in model order."""
        with self.factory() as session:
            run = find_run(session, name)
            rows = session.execute(select(Layer.idx, Layer.name).where(Layer.run_id == run.id).order_by(Layer.idx))
            return [{"index": int(i), "name": n} for i, n in rows]

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
        self,
        conn: Connection,
        key: dict[str, int],
        lo: int,
        hi: int,
        layer: int | None,
        n_layers: int,
        raw_from: int = 0,
    ) -> tuple[I64, Partials]:
        """Partials of the raw points in [lo, hi], one per step; before ``raw_from`` (where retention dropped them:
        a block boundary) those of the base rollup blocks instead, keyed by their first step (a block holding ``lo``
        starts before it)."""
        width = 1 if layer is not None else n_layers
        if lo > hi:
            return np.zeros(0, dtype=np.int64), Partials.empty(0, width)
        if lo < raw_from:
            cut, base = min(hi + 1, raw_from), LEVELS[0]
            b_steps, blocks = self._rollup_partials(
                conn, key["run_id"], key["rank"], key["nid"], base, lo // base, (cut - 1) // base, layer, n_layers
            )
            r_steps, raw = self._raw_partials(conn, key, cut, hi, layer, n_layers)
            return np.concatenate([b_steps, r_steps]), Partials.concat([blocks, raw])
        rows = self._points.read(conn, key, lo, hi, None, n_layers, layer=layer)  # no lock: see raw_points
        return rows.steps, Partials.from_values(rows.values)

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
        if layer is not None and self._layer_group_rows is not None:
            g = layer // GROUP_LAYERS
            params |= {"layer": layer, "g": g, "head_len": HEADER_SIZE + 4 * (g + 1)}
            rows = conn.execute(self._layer_group_rows, params).all()
            buckets = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            return buckets * level, decode_layer([r[1] for r in rows], [r[2] for r in rows], layer)
        # SQLite reads one layer's blocks whole: it has no get_byte to find the group with, and it reads the whole
        # value of a substr() from its pages anyway.
        buckets, blobs = columns(conn.execute(self._block_rows, params).all())
        return buckets * level, decode_blocks(blobs, n_layers, layer)

    def _unstored(
        self,
        conn: Connection,
        key: dict[str, int],
        level: int,
        first: int,
        last: int,
        stored: I64,
        layer: int | None,
        n_layers: int,
        raw_from: int,
    ) -> tuple[I64, Partials]:
        """The raw points of the blocks of ``level`` in [first, last] that are not ``stored`` (too few samples to be
        stored, or none at all: see rollup_writes): one raw read per run of such blocks, or one over all of them
        when they are scattered (a run of few samples per block). Before ``raw_from`` the base blocks stand in for
        the raw points retention dropped (it stores every base block of those steps first)."""
        missing = np.setdiff1d(np.arange(first, last + 1, dtype=np.int64), stored)
        if not missing.size:
            return np.zeros(0, dtype=np.int64), Partials.empty(0, 1 if layer is not None else n_layers)
        breaks = np.flatnonzero(np.diff(missing) > 1)
        if breaks.size >= MAX_GAP_READS:
            spans = [(int(missing[0]), int(missing[-1]))]
        else:
            ends = [*missing[breaks].tolist(), int(missing[-1])]
            spans = list(zip([int(missing[0]), *missing[breaks + 1].tolist()], ends, strict=True))
        found = [
            self._raw_partials(conn, key, a * level, (b + 1) * level - 1, layer, n_layers, raw_from) for a, b in spans
        ]
        steps = np.concatenate([f[0] for f in found])
        take = np.flatnonzero(np.isin(steps // level, missing))
        return steps[take], Partials.concat([f[1] for f in found]).take(take)

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
        frontier: int,
        raw_from: int = 0,
    ) -> tuple[I64, Partials]:
        """Partials per aligned bucket of ``width`` steps over [lo, hi]; keys are bucket indexes (step // width).

        Rollup blocks are used only where they end before the rank's ``frontier`` (``compacted_step``): later steps
        come from the raw points, whose blocks may not be built yet, as do the steps of blocks not stored. Before
        ``raw_from`` (``raw_from_step``: where retention dropped the raw points) the base blocks stand in for them, so
        there ``width`` must be a multiple of the base level (see :func:`retained_width`)."""
        levels = [lv for lv in LEVELS if lv <= width]
        key = {"run_id": run_id, "rank": rank, "nid": nid}
        if not levels:
            steps, part = self._raw_partials(conn, key, lo, hi, layer, n_layers)
            keys, starts = group_starts(steps // width)
            return keys, part.reduce(starts) if keys.size else part
        level = levels[-1]
        first_full = -(-lo // level)
        last_full = min(hi + 1, frontier) // level - 1
        if first_full > last_full:
            steps, part = self._raw_partials(conn, key, lo, hi, layer, n_layers, raw_from)
        else:
            h_steps, head = self._raw_partials(conn, key, lo, first_full * level - 1, layer, n_layers, raw_from)
            m_steps, mid = self._rollup_partials(conn, run_id, rank, nid, level, first_full, last_full, layer, n_layers)
            stored = m_steps // level
            g_steps, gaps = self._unstored(conn, key, level, first_full, last_full, stored, layer, n_layers, raw_from)
            t_steps, tail = self._raw_partials(conn, key, (last_full + 1) * level, hi, layer, n_layers, raw_from)
            steps = np.concatenate([h_steps, m_steps, g_steps, t_steps])
            part = Partials.concat([head, mid, gaps, tail])
            if g_steps.size:
                order = np.argsort(steps, kind="stable")
                steps, part = steps[order], part.take(order)
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
            run_id, n_layers, idx, nid, first_step, last_step, frontier, raw_from = keys_row
            if idx is None:
                raise NotFoundError(f"layer {layer!r} not found in run {run!r}")
            if nid is None:
                raise NotFoundError(f"metric {metric!r} not found in this run")
            lo = first_step if start is None else start
            hi = last_step if end is None else end
            if first_step is None or lo > hi:
                return {"steps": [], "min": [], "mean": [], "max": [], "bucket_steps": 1, "estimated": []}
            dropped = lo < raw_from  # retention dropped raw points of this range
            width = 1
            if hi - lo + 1 > max_points:
                # Only whether the range holds more than max_points samples matters: count at most max_points + 1
                # (where retention dropped them they cannot be counted: taken as more).
                key = {"run_id": run_id, "rank": rank, "nid": nid}
                if dropped or self._points.steps(conn, key, lo, hi, max_points + 1).size > max_points:
                    width = choose_width(lo, hi, max_points)
            width = retained_width(width, dropped)
            keys, part = self._bucketed(
                conn, run_id, rank, nid, lo, hi, width, int(idx), int(n_layers), int(frontier), int(raw_from)
            )
            params = {"run_id": run_id, "rank": rank, "nid": nid, "lo": lo, "hi": hi}
            marked = {int(step) for (step,) in conn.execute(self._estimated_steps, params)}
            # Reads hold no lock: a retention sweep that committed since raw_from was read may have dropped raw
            # points this read took as kept (only behind the frontier). Then read again, with the new cut.
            if lo < frontier and read_raw_from(conn, run_id, rank) != raw_from:
                return self.series(run, metric, layer, rank, start, end, max_points)
        answer = self._series_answer(
            keys, width, lo, part.vmin[:, 0], part.vmax[:, 0], part.mean()[:, 0], part.vcount[:, 0]
        )
        # The buckets holding an estimated point, by their first step as ``steps`` gives it.
        buckets = {max((step // width) * width, lo) for step in marked}
        answer["estimated"] = [int(step) for step in answer["steps"] if int(step) in buckets]
        if dropped:
            answer["raw_from_step"] = int(raw_from)
        return answer

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
            "estimated": [],  # scalars are always exact; a layer series sets its estimated buckets
        }

    def scalar_series(
        self, run: str, scalar: str, rank: int, start: int | None, end: int | None, max_points: int
    ) -> dict[str, Any]:
        """The same as :meth:`series` for a per-run scalar (float64, from raw rows)."""
        with self.factory() as session:
            r = find_run(session, run)
            nid = self._name_id(session, r.id, scalar, "scalar")
            rng = self._range(session, r.id, rank, start, end)
            if rng is None:
                return {"steps": [], "min": [], "mean": [], "max": [], "bucket_steps": 1, "estimated": []}
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
            return {"steps": [], "min": [], "mean": [], "max": [], "bucket_steps": width, "estimated": []}
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
            r = find_run(session, run)
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
            frontier = session.get(RunRank, (r.id, rank))  # in the session already: read by _range
            compacted, raw_from = (0, 0) if frontier is None else (frontier.compacted_step, frontier.raw_from_step)
            width = retained_width(choose_width(lo, hi, max_steps), lo < raw_from)
            keys, part = self._bucketed(
                session.connection(),
                r.id,
                rank,
                nid,
                lo,
                hi,
                width,
                None,
                r.layer_count,
                compacted,
                raw_from,
            )
            if lo < compacted and read_raw_from(session.connection(), r.id, rank) != raw_from:  # see series
                return self.heatmap(run, metric, rank, start, end, max_steps, layers, agg)
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
            full = np.full((n_cols, len(chosen)), np.nan, dtype=data.dtype)
            valid = np.zeros((n_cols, len(chosen)), dtype=bool)
            full[pos] = data
            valid[pos] = part.vcount[:, sel] > 0
        answer: dict[str, Any] = {
            "layers": [names[i] for i in chosen],
            "steps": np.maximum(grid * width, lo),
            "values": to_json_matrix(full.T, valid.T),
            "bucket_steps": width,
        }
        if lo < raw_from:
            answer["raw_from_step"] = raw_from
        return answer

    def step_ranks(self, run: str, metric: str, step: int) -> dict[str, Any]:
        """Layers (model order) × the run's ranks of ``metric`` at the first step at or after ``step`` that some rank
        measured it (``step`` None when none did); a rank without a point there is not measured (null)."""
        with self.factory() as session:
            r = find_run(session, run)
            nid = self._name_id(session, r.id, metric, "layer")
            names = [n for (n,) in session.execute(select(Layer.name).where(Layer.run_id == r.id).order_by(Layer.idx))]
            ranks = [
                int(k)
                for (k,) in session.execute(select(RunRank.rank).where(RunRank.run_id == r.id).order_by(RunRank.rank))
            ]
            conn = session.connection()
            # Per rank: each lookup is one walk of the points index (and of the chunks index) from ``step`` on.
            keys = {rank: {"run_id": r.id, "rank": rank, "nid": nid} for rank in ranks}
            firsts = [self._points.next_step(conn, keys[rank], step) for rank in ranks]
            at = min((s for s in firsts if s is not None), default=None)
            grid = np.repeat(missing_row(len(names))[:, None], len(ranks), axis=1)
            # Only the ranks whose first step is ``at`` have a point there: the others are not read again.
            for i, rank in enumerate(ranks):
                if at is not None and firsts[i] == at:
                    found = self._points.read(conn, keys[rank], at, at, None, len(names))
                    if found.steps.size:
                        grid[:, i] = found.values[0]
        return {
            "step": at,
            "metric": metric,
            "layers": names,
            "ranks": ranks,
            "values": to_json_matrix(grid, ~is_missing(grid)),
        }
