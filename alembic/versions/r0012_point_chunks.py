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
from quantwatch.service.migrations.common import RowId, series_table
from quantwatch.service.store.chunk_codec import decode_steps, decode_times, decode_values

revision: str = "0012_point_chunks"
down_revision: str | None = "0011_alert_state_columns"

BLOBS = ("steps", "times", "vals")


def upgrade() -> None:
    """Create ``point_chunks``, keyed by the series and the chunk's first step."""
    steps = [sa.Column(name, sa.BigInteger(), nullable=False) for name in ("first_step", "last_step")]
    blobs = [sa.Column(blob, sa.LargeBinary(), nullable=False) for blob in BLOBS]
    series_table("point_chunks", *steps, sa.Column("rows", sa.Integer(), nullable=False), *blobs, key=("first_step",))
    if op.get_bind().dialect.name == "postgresql":
        for blob in BLOBS:
            op.execute(f"ALTER TABLE point_chunks ALTER COLUMN {blob} SET STORAGE EXTERNAL")


CHUNKS = sa.table(
    "point_chunks",
    sa.column("first_step", sa.BigInteger()),
    sa.column("run_id", RowId),
    sa.column("rank", sa.Integer()),
    sa.column("name_id", RowId),
    sa.column("rows", sa.Integer()),
    *(sa.column(blob, sa.LargeBinary()) for blob in BLOBS),
)
POINTS = sa.table(
    "points",
    sa.column("run_id", RowId),
    sa.column("rank", sa.Integer()),
    sa.column("step", sa.BigInteger()),
    sa.column("name_id", RowId),
    sa.column("time", sa.Double()),
    sa.column("vals", sa.LargeBinary()),
)


def downgrade() -> None:
    bind = op.get_bind()
    key = (CHUNKS.c.run_id, CHUNKS.c.rank, CHUNKS.c.name_id, CHUNKS.c.first_step)
    for chunk in bind.execute(sa.select(*key).order_by(*key)).all():
        run_id, rank_, nid, rows, steps, times, vals = bind.execute(
            sa.select(*(CHUNKS.c[c] for c in ("run_id", "rank", "name_id", "rows", *BLOBS))).where(
                *(column == value for column, value in zip(key, chunk, strict=True))
            )
        ).one()
        step_list = decode_steps(bytes(steps)).tolist()
        taken = set(
            bind.execute(
                sa.select(POINTS.c.step).where(
                    POINTS.c.run_id == run_id,
                    POINTS.c.rank == rank_,
                    POINTS.c.name_id == nid,
                    POINTS.c.step.in_(step_list),
                )
            ).scalars()
        )
        values = decode_values(bytes(vals)).astype("<f4", copy=False)
        new = [
            {"run_id": run_id, "rank": rank_, "step": s, "name_id": nid, "time": t, "vals": values[i].tobytes()}
            for i, (s, t) in enumerate(zip(step_list, decode_times(bytes(times), int(rows)), strict=True))
            if s not in taken
        ]
        if new:
            bind.execute(sa.insert(POINTS), new)
    op.drop_table("point_chunks")
