"""ORM models of the collector's schema (Alembic owns the DDL; a test checks that both agree).

Per-layer metrics are stored step-major as one row per (run, rank, step, metric) whose ``vals`` blob holds a
little-endian float32 per layer of the run, in the run's layer index order (see README "Storage"). Rollups hold
min/max/sum/count per layer over aligned power-of-four step blocks so long-range reads never touch raw points.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only aliases the rowid (append-only, full pages) for a column declared exactly INTEGER PRIMARY KEY.
RowId = BigInteger().with_variant(Integer(), "sqlite")

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base carrying the constraint naming convention used by the migrations."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One training job, created on first sight by ingest."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[float] = mapped_column(Double)
    layer_count: Mapped[int] = mapped_column(Integer, default=0)

    # AUTOINCREMENT: a deleted run's id is never handed to a new run (in-process caches key on it).
    __table_args__ = {"sqlite_autoincrement": True}  # noqa: RUF012


class RunRank(Base):
    """Progress of one rank of a run; per rank so concurrent ranks never contend for one row."""

    __tablename__ = "run_ranks"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    last_seen_at: Mapped[float] = mapped_column(Double)
    points: Mapped[int] = mapped_column(BigInteger)
    # Rollup blocks ending before this step are complete; reads take later steps from the raw points (issue 21).
    compacted_step: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Retention dropped the raw points before this step (0: none); reads take those steps from rollups (issue 21).
    raw_from_step: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class Layer(Base):
    """A monitored layer of a run; ``idx`` is its position in model order (first-seen order)."""

    __tablename__ = "layers"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(500))

    __table_args__ = (UniqueConstraint("run_id", "name"),)


class MetricName(Base):
    """Dictionary of metric and scalar names, so point rows carry a small integer."""

    __tablename__ = "metric_names"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)


class RunMetric(Base):
    """Which metrics (``kind='layer'``) and scalars (``kind='scalar'``) a run has sent."""

    __tablename__ = "run_metrics"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name_id: Mapped[int] = mapped_column(RowId, ForeignKey("metric_names.id"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)


class Batch(Base):
    """An accepted ingest batch; the primary key makes a retried ``batch_id`` a no-op."""

    __tablename__ = "batches"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[float] = mapped_column(Double)
    points: Mapped[int] = mapped_column(BigInteger)


class Point(Base):
    """Per-layer values of one metric at one step of one rank: ``vals`` is float32 little-endian per layer index.

    A value never measured (``null`` on the wire) is the NaN bit pattern ``MISSING_BITS`` of :mod:`.rollups`; layers
    added to the run after the row was written are missing too (the blob is shorter than the run's layer count).
    """

    __tablename__ = "points"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    name_id: Mapped[int] = mapped_column(RowId, ForeignKey("metric_names.id"))
    time: Mapped[float | None] = mapped_column(Double)
    vals: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (Index("ix_points_key", "run_id", "rank", "step", "name_id", unique=True),)


class PointChunk(Base):
    """Raw points of one (run, rank, metric) folded by the compactor into one compressed chunk (issue 21).

    ``rows`` points at steps ``first_step`` … ``last_step`` (``steps``, sorted, distinct), their times and their
    values as a (rows × ``layers``) float32 matrix, in the blobs of :mod:`.store.chunk_codec`; lossless, so a chunk
    reads back as the raw rows it replaced. Chunks of a series never overlap in steps; a raw row of the same step
    (written after the chunk, by a re-sent or late batch) wins over the chunk's, until the next compaction re-folds it.
    """

    __tablename__ = "point_chunks"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    name_id: Mapped[int] = mapped_column(RowId, ForeignKey("metric_names.id"), primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_step: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    steps: Mapped[bytes] = mapped_column(LargeBinary)
    times: Mapped[bytes] = mapped_column(LargeBinary)
    vals: Mapped[bytes] = mapped_column(LargeBinary)


class Rollup(Base):
    """min, max, sum and count per layer over steps [bucket·level, (bucket+1)·level) of one metric; stored only for
    a block holding at least 16 samples, above level 64 once complete (store/rollup_writes.py)."""

    __tablename__ = "rollups"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    name_id: Mapped[int] = mapped_column(RowId, ForeignKey("metric_names.id"), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    # Every layer's figures in one rollup_codec block (records of rollups.STATS_DTYPE per layer before revision 0017);
    # a one-layer read fetches the header and the layer's group of it (store/reads.py).
    stats: Mapped[bytes] = mapped_column(LargeBinary)

    # WITHOUT ROWID: the key is the table, so a range read of blocks is one b-tree walk, not index + row lookups.
    __table_args__ = {"sqlite_with_rowid": False}  # noqa: RUF012


class ScalarPoint(Base):
    """One per-run figure (loss, tokens_per_second, …) at one step of one rank.

    ``value`` is a little-endian float64 blob: SQLite turns a REAL NaN into NULL, and NaN is a signal to keep.
    """

    __tablename__ = "scalar_points"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    name_id: Mapped[int] = mapped_column(RowId, ForeignKey("metric_names.id"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    time: Mapped[float | None] = mapped_column(Double)
    value: Mapped[bytes] = mapped_column(LargeBinary)


class EstimatedPoint(Base):
    """A metric of one step of one rank that some layer estimated from a subset of rows (the agent's ``shadow_rows``)
    rather than computed exactly; absent: exact."""

    __tablename__ = "estimated_points"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    name_id: Mapped[int] = mapped_column(RowId, ForeignKey("metric_names.id"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class RunAction(Base):
    """An action the agent took on the training job (``quantwatch.agent.actions``, the batch's ``actions``): from
    ``step`` on, ``layer`` (``""``: the whole run) changed as ``detail`` says, asked for by alert ``episode_id`` if any.

    Keyed by what it is, so a re-sent batch stores each action once (migration 0009)."""

    __tablename__ = "run_actions"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    action: Mapped[str] = mapped_column(String(32), primary_key=True)
    layer: Mapped[str] = mapped_column(String(500), primary_key=True)
    detail: Mapped[str] = mapped_column(Text)
    episode_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    recorded_at: Mapped[float] = mapped_column(Double)
