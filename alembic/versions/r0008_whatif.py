"""What-if statistics: each layer's weight, input and gradient error under candidate formats, per step.

One row per (run, rank, step, layer, tensor kind, candidate) of a step's ``whatif`` on the wire; a new table, so
existing data needs no change.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import layer, step_table

revision: str = "0008_whatif"
down_revision: str | None = "0007_rollup_frontier"


def upgrade() -> None:
    step_table(
        "whatif_points",
        layer(),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("candidate", sa.String(67), nullable=False),
        sa.Column("own", sa.Boolean(), nullable=False),
        sa.Column("rel_l2", sa.Double(), nullable=True),
        sa.Column("underflow_ratio", sa.Double(), nullable=True),
        sa.Column("overflow_ratio", sa.Double(), nullable=True),
        key=("layer", "kind", "candidate"),
    )


def downgrade() -> None:
    op.drop_table("whatif_points")
