"""A token per run that every change of its firing episodes redraws (issue 21).

The ingest answer lists the run's firing episodes; with hundreds firing, reading and encoding that list was up to a
third of a one-step batch's CPU. ``alert_firing_tokens`` holds one random token per run, redrawn in the transaction
of every change to that list (on every replica, and by the rule routes), so a process re-reads the list only when the
token moved. No row means token 0: the upgrade writes none. The downgrade drops the table (tokens are derived: they
carry no data of their own).
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0013_alert_firing_tokens"
down_revision: str | None = "0011_alert_state_columns"


def upgrade() -> None:
    op.create_table(
        "alert_firing_tokens",
        sa.Column("run", sa.String(200), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run", name="pk_alert_firing_tokens"),
    )


def downgrade() -> None:
    op.drop_table("alert_firing_tokens")
