"""Rollups: a 128-step level between 64 and 256, backfilled from the stored 64-step blocks.

A 1,000-point series of a 100,000-step run reads buckets of 128 steps; with levels 64, 256, … it read two level-64
blocks per bucket. Ingest now writes level 128 too; this fills it in for the history stored before. The schema is
unchanged (``rollups.level`` is data), so the backfill is the whole migration; downgrading deletes the level.

Self-contained on purpose (a migration must not change meaning when the application code moves on): the record
layout is the one of revision 0001, per layer min float32, max float32, sum float64, count uint16, little-endian.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa

from alembic import op

revision: str = "0003_rollup_level_128"
down_revision: str | None = "0002_alerts"

RECORD = np.dtype([("min", "<f4"), ("max", "<f4"), ("sum", "<f8"), ("count", "<u2")])
# Level-64 blocks read per round trip (even, so a level-128 block never straddles two pages): ~9 MiB at 512 layers.
PAGE_BLOCKS = 1024

rollups = sa.table(
    "rollups",
    sa.column("run_id", sa.BigInteger),
    sa.column("rank", sa.Integer),
    sa.column("name_id", sa.BigInteger),
    sa.column("level", sa.Integer),
    sa.column("bucket", sa.BigInteger),
    sa.column("stats", sa.LargeBinary),
)


def combine_pairs(buckets: np.ndarray, blobs: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """Level-128 records from sorted level-64 ``buckets`` and their stats blobs. A block is as wide as its widest
    child (blobs written before the run gained layers are narrower; the missing layers combine as identities)."""
    widths = np.array([len(b) // RECORD.itemsize for b in blobs], dtype=np.int64)
    width = int(widths.max())
    rec = np.zeros((len(blobs), width), RECORD)
    rec["min"], rec["max"] = np.inf, -np.inf
    for i, blob in enumerate(blobs):
        row = np.frombuffer(blob, RECORD)
        rec[i, : row.size] = row
    keys = buckets // 2
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    out = np.empty((starts.size, width), RECORD)
    out["min"] = np.minimum.reduceat(rec["min"], starts, axis=0)
    out["max"] = np.maximum.reduceat(rec["max"], starts, axis=0)
    out["sum"] = np.add.reduceat(rec["sum"], starts, axis=0)
    out["count"] = np.add.reduceat(rec["count"], starts, axis=0)
    out_widths = np.maximum.reduceat(widths, starts).tolist()
    return [(int(k), out[i, : out_widths[i]].tobytes()) for i, k in enumerate(keys[starts].tolist())]


def upgrade() -> None:
    conn = op.get_bind()
    c = rollups.c
    series = conn.execute(
        sa.select(c.run_id, c.rank, c.name_id, sa.func.min(c.bucket), sa.func.max(c.bucket))
        .where(c.level == 64)
        .group_by(c.run_id, c.rank, c.name_id)
    ).all()
    for run_id, rank, name_id, first, last in series:
        key = (c.run_id == run_id, c.rank == rank, c.name_id == name_id, c.level == 64)
        for lo in range(first - first % 2, last + 1, PAGE_BLOCKS):
            rows = conn.execute(
                sa.select(c.bucket, c.stats).where(*key, c.bucket >= lo, c.bucket < lo + PAGE_BLOCKS).order_by(c.bucket)
            ).all()
            if not rows:
                continue
            buckets = np.array([r[0] for r in rows], dtype=np.int64)
            records = combine_pairs(buckets, [bytes(r[1]) for r in rows])
            conn.execute(
                rollups.insert(),
                [
                    {"run_id": run_id, "rank": rank, "name_id": name_id, "level": 128, "bucket": b, "stats": s}
                    for b, s in records
                ],
            )


def downgrade() -> None:
    op.execute(rollups.delete().where(rollups.c.level == 128))
