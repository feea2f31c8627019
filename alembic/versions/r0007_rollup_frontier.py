"""Rollups: a per-rank compaction frontier, so ingest writes raw points and builds rollups from complete blocks.

``run_ranks.compacted_step``: every rollup block that ends before this step is complete; reads combine those blocks
with the raw points from the frontier on (the raw tail), so answers stay exact while the rollups trail the ingest
path (issue 21). Rows stored before this revision had every rollup written per batch, so their frontier starts just
past their last step.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import drop_rank_column

revision: str = "0007_rollup_frontier"
down_revision: str | None = "0006_estimated"


def upgrade() -> None:
    with op.batch_alter_table("run_ranks") as batch:
        batch.add_column(sa.Column("compacted_step", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute("UPDATE run_ranks SET compacted_step = last_step + 1")


def downgrade() -> None:
    # The code before this revision reads every rollup block as current, so it would answer wrongly for a raw tail
    # that has no blocks yet: refuse rather than drop the frontier of such a rank.
    drop_rank_column(
        "compacted_step",
        "compacted_step <= last_step",
        "hold steps past their rollup frontier (run_ranks.compacted_step); downgrading below 0007_rollup_frontier "
        "would make their reads wrong",
    )
