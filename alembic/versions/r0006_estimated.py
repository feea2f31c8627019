"""Estimated points: the (run, rank, metric, step) figures the agent estimated from a subset of rows (``shadow_rows``).

One row per estimated metric of a step (a step's ``estimated`` on the wire); a point without a row is exact, so
existing data needs no change.

Revision ID: 0006_estimated
Revises: 0005_ranks
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0006_estimated"
down_revision: str | None = "0005_ranks"

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "estimated_points",
        sa.Column("run_id", RowId, nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("name_id", RowId, nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_estimated_points_run_id_runs", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["name_id"], ["metric_names.id"], name="fk_estimated_points_name_id_metric_names"),
        sa.PrimaryKeyConstraint("run_id", "rank", "name_id", "step", name="pk_estimated_points"),
    )


def downgrade() -> None:
    op.drop_table("estimated_points")
