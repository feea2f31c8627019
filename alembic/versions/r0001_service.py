"""Collector schema: runs, ranks, layers, metric names, batches, float32 point blobs, rollups, scalars.

Revision ID: 0001_service
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from alembic import op

revision: str = "0001_service"
down_revision: str | None = None

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _runs_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=f"fk_{table}_run_id_runs", ondelete="CASCADE")


def _metric_names_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["name_id"], ["metric_names.id"], name=f"fk_{table}_name_id_metric_names")


def _series_table(table: str, *columns: sa.Column[Any], key: tuple[str, ...], **options: Any) -> None:
    """A table of one metric series' rows: (run, rank, metric name) and ``columns``, keyed by the series and ``key``."""
    op.create_table(
        table,
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("name_id", RowId, nullable=False),
        *columns,
        _runs_fk(table),
        _metric_names_fk(table),
        sa.PrimaryKeyConstraint("run_id", "rank", "name_id", *key, name=f"pk_{table}"),
        **options,
    )


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
    op.create_table(
        "run_ranks",
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.Column("points", sa.BigInteger(), nullable=False),
        _runs_fk("run_ranks"),
        sa.PrimaryKeyConstraint("run_id", "rank", name="pk_run_ranks"),
    )
    op.create_table(
        "layers",
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(500), nullable=False),
        _runs_fk("layers"),
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
    op.create_table(
        "run_metrics",
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("name_id", RowId, nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        _runs_fk("run_metrics"),
        _metric_names_fk("run_metrics"),
        sa.PrimaryKeyConstraint("run_id", "name_id", "kind", name="pk_run_metrics"),
    )
    op.create_table(
        "batches",
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("batch_id", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.Column("points", sa.BigInteger(), nullable=False),
        _runs_fk("batches"),
        sa.PrimaryKeyConstraint("run_id", "batch_id", name="pk_batches"),
    )
    op.create_table(
        "points",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("name_id", RowId, nullable=False),
        sa.Column("time", sa.Double(), nullable=True),
        sa.Column("vals", sa.LargeBinary(), nullable=False),
        _runs_fk("points"),
        _metric_names_fk("points"),
        sa.PrimaryKeyConstraint("id", name="pk_points"),
    )
    op.create_index("ix_points_key", "points", ["run_id", "rank", "step", "name_id"], unique=True)
    _series_table(
        "rollups",
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("stats", sa.LargeBinary(), nullable=False),
        key=("level", "bucket"),
        sqlite_with_rowid=False,
    )
    _series_table(
        "scalar_points",
        sa.Column("step", sa.BigInteger(), nullable=False),
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
