"""Layer formats: each layer's number format per tensor kind with the step it took effect; baseline state.

``layer_formats`` keeps one row per change (run, layer, kind, step → format), so a layer whose format changes mid-run
keeps its history. ``alert_series`` gains the state of baseline-relative rules: the first samples of a series
(``baseline``) and the step of the format change they were collected after (``baseline_since``). Existing series
have neither: a baseline rule starts collecting at their next sample.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import layer, run_table, step

revision: str = "0004_layer_formats"
down_revision: str | None = "0003_rollup_level_128"


def upgrade() -> None:
    run_table(
        "layer_formats",
        layer(),
        sa.Column("kind", sa.String(8), nullable=False),
        step(),
        sa.Column("format", sa.String(64), nullable=False),
        sa.Column("recorded_at", sa.Double(), nullable=False),
        key=("layer", "kind", "step"),
    )
    with op.batch_alter_table("alert_series") as batch:
        batch.add_column(sa.Column("baseline", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("baseline_since", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("alert_series") as batch:
        batch.drop_column("baseline_since")
        batch.drop_column("baseline")
    op.drop_table("layer_formats")
