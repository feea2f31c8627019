"""Actions: what the agent did to the training job (``quantwatch.agent.actions``), recorded on the run (issue 18).

One row per (run, rank, step, action, layer): the batch's ``actions`` on the wire. A new table; existing data needs no
change.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import layer, step_table

revision: str = "0010_actions"
down_revision: str | None = "0009_alert_series_states"


def upgrade() -> None:
    step_table(
        "run_actions",
        sa.Column("action", sa.String(32), nullable=False),
        layer(),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("episode_id", sa.BigInteger(), nullable=True),
        sa.Column("recorded_at", sa.Double(), nullable=False),
        key=("action", "layer"),
    )


def downgrade() -> None:
    op.drop_table("run_actions")
