"""Estimated points: the (run, rank, metric, step) figures the agent estimated from a subset of rows (``shadow_rows``).

One row per estimated metric of a step (a step's ``estimated`` on the wire); a point without a row is exact, so
existing data needs no change.
"""

from __future__ import annotations

from alembic import op
from quantwatch.service.migrations.common import series_table, step

revision: str = "0006_estimated"
down_revision: str | None = "0005_ranks"


def upgrade() -> None:
    series_table("estimated_points", step(), key=("step",))


def downgrade() -> None:
    op.drop_table("estimated_points")
