"""Lean storage: point chunks in version 2 of their codec, and rollup blocks of few samples not stored (issue 21).

No schema change. From this revision the collector folds raw points into chunks by default, in version 2 of the codec
(``quantwatch.service.store.chunk_codec``), writes a rollup block above the base level once it is complete, and
stores no block holding fewer than 16 samples: reads take those steps from the raw points. The upgrade changes
nothing (chunks of version 1 and every stored block stay valid). The downgrade gives the code before it what that
code reads: every chunk decoded back into raw rows (it reads version 1 only; with folding on it folds them again),
and every rollup block of every level not stored built from the raw points (it takes a missing block for one without
steps); the blocks stored stay as they are. It refuses while retention has dropped some rank's raw points: the
blocks not stored there cannot be built again.
"""

from __future__ import annotations

import numpy as np
import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import RowId, refuse_ranks
from quantwatch.service.migrations.point_chunks import POINTS, unfold_chunks
from quantwatch.service.rollups import Partials, group_starts, rows_from_blobs

revision: str = "0015_lean_storage"
down_revision: str | None = "0014_retention"

LEVELS = (64, 128, 256, 1024, 4096)
"""The rollup levels at this revision (frozen: the code's may change)."""
ROLLUPS = sa.table(
    "rollups",
    sa.column("run_id", RowId),
    sa.column("rank", sa.Integer()),
    sa.column("name_id", RowId),
    sa.column("level", sa.Integer()),
    sa.column("bucket", sa.BigInteger()),
    sa.column("stats", sa.LargeBinary()),
)
RUNS = sa.table("runs", sa.column("id", RowId), sa.column("layer_count", sa.Integer()))


def upgrade() -> None:
    """Nothing to change: what the revision before stored is valid as it is."""


def downgrade() -> None:
    refuse_ranks(
        "raw_from_step > 0",
        "had raw points dropped by retention (run_ranks.raw_from_step); their rollup blocks of few samples are not "
        "stored and cannot be built again below 0015_lean_storage",
    )
    bind = op.get_bind()
    unfold_chunks(bind)
    widths = {int(r[0]): int(r[1]) for r in bind.execute(sa.select(RUNS.c.id, RUNS.c.layer_count))}
    series = sa.select(POINTS.c.run_id, POINTS.c.rank, POINTS.c.name_id).distinct()
    span = LEVELS[-1]  # every level's blocks lie within one block of the largest
    for run_id, rank, nid in bind.execute(series).all():
        where = (POINTS.c.run_id == run_id, POINTS.c.rank == rank, POINTS.c.name_id == nid)
        stored = {
            (int(level), int(bucket))
            for level, bucket in bind.execute(
                sa.select(ROLLUPS.c.level, ROLLUPS.c.bucket).where(
                    ROLLUPS.c.run_id == run_id, ROLLUPS.c.rank == rank, ROLLUPS.c.name_id == nid
                )
            )
        }
        lo, hi = bind.execute(sa.select(sa.func.min(POINTS.c.step), sa.func.max(POINTS.c.step)).where(*where)).one()
        for window in range(int(lo) // span, int(hi) // span + 1):
            found = bind.execute(
                sa.select(POINTS.c.step, POINTS.c.vals)
                .where(*where, POINTS.c.step >= window * span, POINTS.c.step < (window + 1) * span)
                .order_by(POINTS.c.step)
            ).all()
            if not found:
                continue
            steps = np.array([r[0] for r in found], dtype=np.int64)
            values = Partials.from_values(rows_from_blobs([bytes(r[1]) for r in found], int(widths[run_id])))
            rows: list[dict[str, object]] = []
            for level in LEVELS:
                keys, starts = group_starts(steps // level)
                blocks = values.reduce(starts)
                rows.extend(
                    {
                        "run_id": run_id,
                        "rank": rank,
                        "name_id": nid,
                        "level": level,
                        "bucket": b,
                        "stats": blocks.stats(i),
                    }
                    for i, b in enumerate(keys.tolist())
                    if (level, b) not in stored
                )
            if rows:
                bind.execute(sa.insert(ROLLUPS), rows)
