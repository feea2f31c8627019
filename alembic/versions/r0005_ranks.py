"""Cross-rank checks: fingerprints waiting for their replica group, decided comparisons, rank environments."""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import rank, run_name, step

revision: str = "0005_ranks"
down_revision: str | None = "0004_layer_formats"


def upgrade() -> None:
    """Create the rank tables."""
    op.create_table(
        "rank_fingerprints",
        run_name(),
        sa.Column("group_key", sa.String(400), nullable=False),
        step(),
        rank(),
        sa.Column("prints", sa.JSON(), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run", "group_key", "step", "rank", name="pk_rank_fingerprints"),
    )
    op.create_table(
        "rank_comparisons",
        run_name(),
        sa.Column("group_key", sa.String(400), nullable=False),
        step(),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reported", sa.JSON(), nullable=False),
        sa.Column("mismatches", sa.JSON(), nullable=False),
        sa.Column("decided_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run", "group_key", "step", name="pk_rank_comparisons"),
    )
    op.create_table(
        "rank_environments",
        run_name(),
        rank(),
        sa.Column("environment", sa.JSON(), nullable=False),
        sa.Column("group_key", sa.String(400), nullable=False),
        sa.Column("reported_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run", "rank", name="pk_rank_environments"),
    )


def downgrade() -> None:
    """Drop the rank tables."""
    op.drop_table("rank_environments")
    op.drop_table("rank_comparisons")
    op.drop_table("rank_fingerprints")
