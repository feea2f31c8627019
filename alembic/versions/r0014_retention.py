"""Retention: ``run_ranks.raw_from_step``, the step before which retention dropped a rank's raw points (issue 21).

Reads answer the steps before it from the rollup blocks, which retention never drops. The upgrade starts every rank at
0 (nothing dropped). The downgrade refuses while some rank has had raw points dropped: the code before this revision
reads raw points there and would answer with holes.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import drop_rank_column

revision: str = "0014_retention"
down_revision: str | None = "0013_alert_firing_tokens"


def upgrade() -> None:
    with op.batch_alter_table("run_ranks") as batch:
        batch.add_column(sa.Column("raw_from_step", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    drop_rank_column(
        "raw_from_step",
        "raw_from_step > 0",
        "had raw points dropped by retention (run_ranks.raw_from_step); downgrading below 0014_retention would make "
        "their reads over the dropped steps come back empty",
    )
