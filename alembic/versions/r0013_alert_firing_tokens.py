"""Firing tokens: a random token per (run, rank) that every change of the run's firing episodes redraws (issue 21).

The ingest answer lists the run's firing episodes; with hundreds firing, reading and encoding that list was up to a
third of a one-step batch's CPU. ``alert_firing_tokens`` holds one random token per (run, rank), redrawn in the
transaction of every change to that list made by the rank's ingest (on every replica; rank -1 for the rule routes),
so a process re-reads the list only when one of the run's tokens moved. The upgrade writes no rows (no change since);
the downgrade drops the table (tokens are derived: they carry no data of their own).
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0013_alert_firing_tokens"
down_revision: str | None = "0012_point_chunks"


def upgrade() -> None:
    op.create_table(
        "alert_firing_tokens",
        sa.Column("run", sa.String(200), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run", "rank", name="pk_alert_firing_tokens"),
    )


def downgrade() -> None:
    op.drop_table("alert_firing_tokens")
