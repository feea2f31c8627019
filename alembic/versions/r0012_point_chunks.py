"""Point chunks: the compactor folds complete runs of raw points into compressed chunks (issue 21).

``point_chunks`` holds one row per folded run of raw rows of a (run, rank, metric): their steps, times and values in
the lossless blobs of ``quantwatch.service.store.chunk_codec``. Raw rows stored before this revision stay valid and
are read as they are; the compactor folds those behind a rank's frontier the next time that rank compacts. On
PostgreSQL the blobs are stored ``EXTERNAL``: already compressed, TOAST would only spend time trying again. The
downgrade decodes every chunk back into raw rows (a raw row of the same step, written after its chunk, wins).
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import series_table
from quantwatch.service.migrations.point_chunks import BLOBS, unfold_chunks

revision: str = "0012_point_chunks"
down_revision: str | None = "0011_alert_state_columns"


def upgrade() -> None:
    """Create ``point_chunks``, keyed by the series and the chunk's first step."""
    steps = [sa.Column(name, sa.BigInteger(), nullable=False) for name in ("first_step", "last_step")]
    blobs = [sa.Column(blob, sa.LargeBinary(), nullable=False) for blob in BLOBS]
    series_table("point_chunks", *steps, sa.Column("rows", sa.Integer(), nullable=False), *blobs, key=("first_step",))
    if op.get_bind().dialect.name == "postgresql":
        for blob in BLOBS:
            op.execute(f"ALTER TABLE point_chunks ALTER COLUMN {blob} SET STORAGE EXTERNAL")


def downgrade() -> None:
    unfold_chunks(op.get_bind())
    op.drop_table("point_chunks")
