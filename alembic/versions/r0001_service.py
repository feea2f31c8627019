"""Collector schema: runs, ranks, layers, metric names, batches, float32 point blobs, rollups, scalars."""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import RowId, fk, name_id, rank, run_table, series_table, step

revision: str = "0001_service"
down_revision: str | None = None


def upgrade() -> None:
    """Create the collector tables."""
    op.create_table(
        "runs",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("layer_count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("name", name="uq_runs_name"),
        sqlite_autoincrement=True,
    )
    run_table(
        "run_ranks",
        rank(),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.Column("points", sa.BigInteger(), nullable=False),
        key=("rank",),
    )
    op.create_table(
        "layers",
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(500), nullable=False),
        fk("layers", "run_id", "runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "idx", name="pk_layers"),
        sa.UniqueConstraint("run_id", "name", name="uq_layers_run_id_name"),
    )
    op.create_table(
        "metric_names",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_metric_names"),
        sa.UniqueConstraint("name", name="uq_metric_names_name"),
    )
    run_table(
        "run_metrics", name_id(), sa.Column("kind", sa.String(8), nullable=False), key=("name_id", "kind"), metric=True
    )
    run_table(
        "batches",
        sa.Column("batch_id", sa.String(128), nullable=False),
        rank(),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.Column("points", sa.BigInteger(), nullable=False),
        key=("batch_id",),
    )
    op.create_table(
        "points",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("run_id", RowId, nullable=False),
        rank(),
        step(),
        name_id(),
        sa.Column("time", sa.Double(), nullable=True),
        sa.Column("vals", sa.LargeBinary(), nullable=False),
        fk("points", "run_id", "runs", ondelete="CASCADE"),
        fk("points", "name_id", "metric_names"),
        sa.PrimaryKeyConstraint("id", name="pk_points"),
    )
    op.create_index("ix_points_key", "points", ["run_id", "rank", "step", "name_id"], unique=True)
    series_table(
        "rollups",
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("stats", sa.LargeBinary(), nullable=False),
        key=("level", "bucket"),
        sqlite_with_rowid=False,
    )
    series_table(
        "scalar_points",
        step(),
        sa.Column("time", sa.Double(), nullable=True),
        sa.Column("value", sa.LargeBinary(), nullable=False),
        key=("step",),
    )
    if op.get_bind().dialect.name == "postgresql":
        # Keep the float32 blobs in the heap row, uncompressed (noise does not compress; TOAST would split a
        # 2 KiB blob into two out-of-line chunks).
        op.execute("ALTER TABLE points ALTER COLUMN vals SET STORAGE EXTERNAL")
        op.execute("ALTER TABLE points SET (toast_tuple_target = 8160)")
        # Rollup blobs of wide runs exceed a page and go out of line: uncompressed, so a one-layer slice fetches one
        # chunk instead of decompressing the whole value.
        op.execute("ALTER TABLE rollups ALTER COLUMN stats SET STORAGE EXTERNAL")


def downgrade() -> None:
    """Drop the collector tables."""
    for table in ("scalar_points", "rollups", "points", "batches", "run_metrics", "metric_names", "layers"):
        op.drop_table(table)
    op.drop_table("run_ranks")
    op.drop_table("runs")
