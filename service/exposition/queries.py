"""The exposition's reads from the database, each a function returning plain values (the only SQL of the package).

Two kinds: what a scrape counts (:func:`delivery_counts`), and what the collector rebuilds its exposition state from
at start (:func:`recent_ranks`, :func:`stored_rank`, :func:`open_alert_series`), each bounded by
:class:`RestoreLimits` and served by an index of the tables it reads.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from sqlalchemy import Connection, Integer, bindparam, func, select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.alerts.repository import decode_row
from quantwatch.service.alerts.tables import OPEN_EPISODE_STATES, DeliveryRow, EpisodeRow, RuleRow, SeriesStatesRow
from quantwatch.service.exposition.alert_states import DeliveryCounts, StoredSeries, severity_order
from quantwatch.service.exposition.cache import StoredRank
from quantwatch.service.models import Layer, MetricName, Point, Run, RunMetric, RunRank, ScalarPoint
from quantwatch.service.rollups import is_missing, rows_from_blobs
from quantwatch.service.store.raw_points import RawPoints

__all__ = [
    "RankReader",
    "RecentRun",
    "RestoreLimits",
    "delivery_counts",
    "open_alert_series",
    "recent_runs",
]


def delivery_counts(sessions: sessionmaker[Session]) -> DeliveryCounts:
    """Outbox deliveries per status, read from the database (an index-only count) at scrape time."""

    def count() -> Mapping[str, int]:
        with sessions() as session:
            rows = session.execute(select(DeliveryRow.status, func.count()).group_by(DeliveryRow.status))
            return {str(status): int(total) for status, total in rows}

    return count


@dataclass(frozen=True)
class RestoreLimits:
    """How much the start-up restore reads: the bounds that keep it quick and small on any database.

    ``max_runs``: the most recently seen runs restored (of those within the cache's TTL). Per (run, rank, metric):
    the latest value of each layer comes from the newest rows of the metric, read back at most ``max_rows`` rows and
    ``look_back_steps`` steps, and no further once ``idle_rows`` rows in a row measured no layer still without a
    value (a layer a rank does not measure must not make the restore read the whole history).
    """

    max_runs: int = 1000
    max_rows: int = 32
    idle_rows: int = 4
    look_back_steps: int = 100_000

    def __post_init__(self) -> None:
        for name in ("max_runs", "max_rows", "idle_rows", "look_back_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")


@dataclass(frozen=True)
class RecentRun:
    """A run seen within the TTL: its id, name, newest batch time (any rank) and (rank, last step) of each rank, in
    the order of their newest batches."""

    run_id: int
    name: str
    last_seen: float
    ranks: tuple[tuple[int, int], ...]


def recent_runs(session: Session, since: float, max_runs: int) -> list[RecentRun]:
    """The ``max_runs`` runs whose newest batch (any rank) arrived at or after ``since``, newest first."""
    newest = func.max(RunRank.last_seen_at)
    chosen = (
        select(RunRank.run_id, newest.label("last_seen"))
        .group_by(RunRank.run_id)
        .having(newest >= since)
        .order_by(newest.desc(), RunRank.run_id)
        .limit(max_runs)
        .subquery()
    )
    # Ranks in the order their newest batches came: restored in that order, the top-K across ranks is chosen as
    # the ingest that built it last chose it.
    rows = session.execute(
        select(Run.id, Run.name, chosen.c.last_seen, RunRank.rank, RunRank.last_step)
        .join(chosen, chosen.c.run_id == Run.id)
        .join(RunRank, RunRank.run_id == Run.id)
        .order_by(chosen.c.last_seen.desc(), Run.id, RunRank.last_seen_at, RunRank.rank)
    ).all()
    runs: dict[int, RecentRun] = {}
    for run_id, name, last_seen, rank, last_step in rows:
        known = runs.get(run_id)
        ranks = (*(known.ranks if known else ()), (int(rank), int(last_step)))
        runs[run_id] = RecentRun(int(run_id), str(name), float(last_seen), ranks)
    return list(runs.values())


class _LatestValues:
    """The latest value of each layer of one (run, rank, metric), filled from its rows newest first."""

    def __init__(self, n_layers: int) -> None:
        self.values = np.full(n_layers, np.nan)
        self.measured = np.zeros(n_layers, dtype=np.bool_)
        self.rows_read = self.idle = 0
        self.oldest_step: int | None = None  # the oldest step read so far

    def take(self, step: int, row: npt.NDArray[np.float32]) -> None:
        """Take one stored row (older than every row taken before)."""
        new = ~is_missing(row) & ~self.measured
        if new.any():
            self.values[new] = row[new]
            self.measured |= new
            self.idle = 0
        else:
            self.idle += 1
        self.rows_read += 1
        self.oldest_step = step

    def done(self, limits: RestoreLimits) -> bool:
        """Whether older rows need not be read: every layer has a value, or the limits are reached."""
        return bool(self.measured.all()) or self.idle >= limits.idle_rows or self.rows_read >= limits.max_rows


class RankReader:
    """Reads what the database holds of the (run, rank)s of recent runs, with statements built once."""

    def __init__(self, limits: RestoreLimits) -> None:
        self.limits = limits
        run_id, rank = bindparam("run_id", type_=Integer), bindparam("rank", type_=Integer)
        self._layers = select(Layer.name).where(Layer.run_id == run_id).order_by(Layer.idx)
        self._names = (
            select(MetricName.id, MetricName.name, RunMetric.kind)
            .join(RunMetric, RunMetric.name_id == MetricName.id)
            .where(RunMetric.run_id == run_id)
            .order_by(MetricName.name)
        )
        # The newest rows of a rank, all metrics together (index ix_points_key): usually every metric's newest row.
        self._newest = (
            select(Point.name_id, Point.step, Point.vals)
            .where(Point.run_id == run_id, Point.rank == rank, Point.step <= bindparam("last_step"))
            .order_by(Point.step.desc(), Point.name_id.desc())
            .limit(bindparam("rows", type_=Integer))
        )
        # Older rows of one metric (raw rows and chunks), for a metric the newest rows left without some layer.
        self._points = RawPoints()
        self._frontier = select(RunRank.compacted_step).where(RunRank.run_id == run_id, RunRank.rank == rank)
        self._scalar = (
            select(ScalarPoint.value)
            .where(ScalarPoint.run_id == run_id, ScalarPoint.rank == rank, ScalarPoint.name_id == bindparam("name_id"))
            .order_by(ScalarPoint.step.desc())
            .limit(1)
        )

    def stored_ranks(self, session: Session, run: RecentRun) -> Iterator[StoredRank]:
        """Per rank of ``run``: the latest value of every layer per metric (the newest stored step that measured
        it), the latest value of every scalar, and the rank's last step."""
        conn = session.connection()
        layers = tuple(str(name) for (name,) in conn.execute(self._layers, {"run_id": run.run_id}))
        names = conn.execute(self._names, {"run_id": run.run_id}).all()
        metrics = {int(name_id): str(name) for name_id, name, kind in names if kind == "layer"}
        scalars = {int(name_id): str(name) for name_id, name, kind in names if kind != "layer"}
        for rank, last_step in run.ranks:
            key = {"run_id": run.run_id, "rank": rank}
            latest = self._latest(conn, key, last_step, metrics, len(layers))
            values: dict[str, float] = {}
            for name_id, name in scalars.items():
                blob = conn.execute(self._scalar, {**key, "name_id": name_id}).scalar()
                if blob is not None:
                    values[name] = struct.unpack("<d", bytes(blob))[0]
            yield StoredRank(run.name, rank, layers, last_step, run.last_seen, latest, values)

    def _latest(
        self, conn: Connection, key: dict[str, int], last_step: int, metrics: Mapping[int, str], n_layers: int
    ) -> dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]]:
        if not metrics:
            return {}
        limits = self.limits
        fills = {name_id: _LatestValues(n_layers) for name_id in metrics}
        page = 2 * len(metrics)
        rows = conn.execute(self._newest, {**key, "last_step": last_step, "rows": page}).all()
        # Read after the page: a fold committed since the page's read moved it past every row it deleted.
        frontier = int(conn.execute(self._frontier, key).scalar() or 0)
        full = len(rows) == page
        cut = int(rows[-1][1]) if full else frontier
        # Chunks hold only steps behind the frontier: the raw page is the whole history from max(frontier, cut) on.
        trusted = max(frontier, cut)
        for (name_id, step, _), row in zip(rows, rows_from_blobs([bytes(r[2]) for r in rows], n_layers), strict=True):
            fill = fills.get(int(name_id))
            if fill is not None and int(step) >= trusted and not fill.done(limits):
                fill.take(int(step), row)
        if full or frontier > 0:  # older rows may exist: read on for the metrics still without every layer
            for name_id, fill in fills.items():
                before = trusted
                if full and cut >= frontier:
                    # A full page holds every row newer than its oldest step ``cut``, and some of those at ``cut``.
                    before = cut if fill.oldest_step == cut else cut + 1
                self._read_older(conn, {**key, "nid": name_id}, before, last_step, fill)
        return {
            metrics[name_id]: (fill.values, fill.measured) for name_id, fill in fills.items() if fill.measured.any()
        }

    def _read_older(
        self, conn: Connection, key: dict[str, int], before: int, last_step: int, fill: _LatestValues
    ) -> None:
        """Rows of one metric before ``before``, newest first, until ``fill`` is done or the look-back ends."""
        limits = self.limits
        floor = max(0, last_step - limits.look_back_steps)
        hi, span = before - 1, 2 * limits.idle_rows
        while not fill.done(limits) and hi >= floor:
            lo = max(floor, hi - span + 1)
            found = self._points.read(conn, key, lo, hi, None, len(fill.values))  # no lock: frontier may be stale
            for i in range(found.steps.size - 1, -1, -1):
                fill.take(int(found.steps[i]), found.values[i])
                if fill.done(limits):
                    return
            hi, span = lo - 1, span * 2


def open_alert_series(session: Session, runs: Sequence[str], per_group: int) -> list[StoredSeries]:
    """Pending and firing series of ``runs`` whose (rule, run, layer) has an open episode, per rank.

    Read from the open episodes (index ``ix_alert_episodes_run_state``) to their ranks' series states (primary key):
    at most ``per_group`` per (rule, run, rank), the most severe and longest streaks first, as the exposition
    exports them.
    """
    if not runs:
        return []
    opened: dict[tuple[int, str], tuple[str, list[str]]] = {}
    for rule_id, rule, run, layer in session.execute(
        select(RuleRow.id, RuleRow.name, EpisodeRow.run, EpisodeRow.layer)
        .join(RuleRow, RuleRow.id == EpisodeRow.rule_id)
        .where(EpisodeRow.run.in_(list(runs)), EpisodeRow.state.in_(OPEN_EPISODE_STATES))
    ):
        opened.setdefault((rule_id, run), (rule, []))[1].append(layer)
    rows = session.execute(
        select(SeriesStatesRow.rule_id, SeriesStatesRow.run, SeriesStatesRow.rank, SeriesStatesRow.series).where(
            SeriesStatesRow.run.in_(list(runs)), SeriesStatesRow.rule_id.in_(sorted({key[0] for key in opened}))
        )
    ).all()
    groups: dict[tuple[str, str, int], list[StoredSeries]] = {}
    for rule_id, run, rank, stored in rows:
        rule, layers = opened.get((rule_id, run), ("", []))
        states = decode_row(rule, stored)
        for layer in layers:
            state = states.get((rule, layer))
            if state is not None and state.status.value in OPEN_EPISODE_STATES:
                series = StoredSeries(rule, str(run), int(rank), layer, state.status.value, state.streak)
                groups.setdefault((series.rule, series.run, series.rank), []).append(series)
    return [
        series
        for group in groups.values()
        for series in sorted(group, key=lambda s: severity_order(s.status, s.streak, s.layer))[:per_group]
    ]
