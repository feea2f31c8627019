"""The exposition's reads from the database, each a function returning plain values (the only SQL of the package).

Two kinds: what a scrape counts (:func:`delivery_counts`), and what the collector rebuilds its exposition state from
at start (:func:`recent_ranks`, :func:`stored_rank`, :func:`open_alert_series`), each bounded by
:class:`RestoreLimits` and served by an index of the tables it reads.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.alerts.tables import OPEN_EPISODE_STATES, DeliveryRow, EpisodeRow, RuleRow, SeriesStateRow
from quantwatch.service.exposition.alert_states import DeliveryCounts, StoredSeries, severity_order
from quantwatch.service.exposition.cache import StoredRank
from quantwatch.service.models import Layer, MetricName, Point, Run, RunMetric, RunRank, ScalarPoint
from quantwatch.service.rollups import is_missing, rows_from_blobs

__all__ = [
    "RecentRun",
    "RestoreLimits",
    "delivery_counts",
    "open_alert_series",
    "recent_runs",
    "stored_rank",
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


def stored_rank(session: Session, run: RecentRun, rank: int, last_step: int, limits: RestoreLimits) -> StoredRank:
    """What the database holds of one (run, rank) for the exposition: the latest value of every layer per metric,
    the latest value of every scalar, and the rank's last step."""
    layers = tuple(
        str(name)
        for (name,) in session.execute(select(Layer.name).where(Layer.run_id == run.run_id).order_by(Layer.idx))
    )
    names = session.execute(
        select(MetricName.id, MetricName.name, RunMetric.kind)
        .join(RunMetric, RunMetric.name_id == MetricName.id)
        .where(RunMetric.run_id == run.run_id)
        .order_by(MetricName.name)
    ).all()
    latest: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]] = {}
    scalars: dict[str, float] = {}
    for name_id, name, kind in names:
        if kind == "layer":
            values, measured = _latest_layer_values(
                session, run.run_id, rank, int(name_id), last_step, len(layers), limits
            )
            if measured.any():
                latest[str(name)] = (values, measured)
        else:
            blob = session.execute(
                select(ScalarPoint.value)
                .where(ScalarPoint.run_id == run.run_id, ScalarPoint.rank == rank, ScalarPoint.name_id == name_id)
                .order_by(ScalarPoint.step.desc())
                .limit(1)
            ).scalar()
            if blob is not None:
                scalars[str(name)] = struct.unpack("<d", bytes(blob))[0]
    return StoredRank(run.name, rank, layers, last_step, run.last_seen, latest, scalars)


def _latest_layer_values(
    session: Session, run_id: int, rank: int, name_id: int, last_step: int, n_layers: int, limits: RestoreLimits
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Per layer, the value at the newest step that measured it (newest rows first, within the limits)."""
    values = np.full(n_layers, np.nan)
    measured = np.zeros(n_layers, dtype=np.bool_)
    cursor, floor = last_step + 1, last_step - limits.look_back_steps
    read = idle = 0
    page = 1  # the newest row usually measures every layer: read it alone first
    while read < limits.max_rows:
        rows = session.execute(
            select(Point.step, Point.vals)
            .where(
                Point.run_id == run_id,
                Point.rank == rank,
                Point.name_id == name_id,
                Point.step < cursor,
                Point.step >= floor,
            )
            .order_by(Point.step.desc())
            .limit(min(page, limits.max_rows - read))
        ).all()
        if not rows:
            break
        for row in rows_from_blobs([bytes(vals) for _, vals in rows], n_layers):
            read += 1
            new = ~is_missing(row) & ~measured
            if new.any():
                values[new] = row[new]
                measured |= new
                idle = 0
            else:
                idle += 1
            if measured.all() or idle >= limits.idle_rows:
                return values, measured
        cursor, page = int(rows[-1][0]), 2 * limits.idle_rows
    return values, measured


def open_alert_series(session: Session, runs: Sequence[str], per_group: int) -> list[StoredSeries]:
    """Pending and firing series of ``runs`` whose (rule, run, layer) has an open episode, per rank.

    Read from the open episodes (index ``ix_alert_episodes_run_state``) to their series (primary key): at most
    ``per_group`` per (rule, run, rank), the most severe and longest streaks first, as the exposition exports them.
    """
    if not runs:
        return []
    rows = session.execute(
        select(RuleRow.name, SeriesStateRow.run, SeriesStateRow.rank, SeriesStateRow.layer, SeriesStateRow.status)
        .add_columns(SeriesStateRow.streak)
        .join(
            EpisodeRow,
            (EpisodeRow.rule_id == SeriesStateRow.rule_id)
            & (EpisodeRow.run == SeriesStateRow.run)
            & (EpisodeRow.layer == SeriesStateRow.layer),
        )
        .join(RuleRow, RuleRow.id == SeriesStateRow.rule_id)
        .where(
            EpisodeRow.run.in_(list(runs)),
            EpisodeRow.state.in_(OPEN_EPISODE_STATES),
            SeriesStateRow.status.in_(OPEN_EPISODE_STATES),
        )
    ).all()
    groups: dict[tuple[str, str, int], list[StoredSeries]] = {}
    for rule, run, rank, layer, status, streak in rows:
        series = StoredSeries(str(rule), str(run), int(rank), str(layer), str(status), int(streak))
        groups.setdefault((series.rule, series.run, series.rank), []).append(series)
    return [
        series
        for group in groups.values()
        for series in sorted(group, key=lambda s: severity_order(s.status, s.streak, s.layer))[:per_group]
    ]
