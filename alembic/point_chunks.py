"""What revisions 0012 and 0015 both do to point chunks: decode every chunk back into raw rows.

Frozen like the revisions (see :mod:`.common`): change nothing here that alters what an applied revision does.
"""

from __future__ import annotations

import sqlalchemy as sa

from quantwatch.service.migrations.common import RowId
from quantwatch.service.store.chunk_codec import decode_steps, decode_times, decode_values

BLOBS = ("steps", "times", "vals")
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


def unfold_chunks(bind: sa.Connection) -> None:
    """Decode every chunk into raw rows (a raw row of the same step, written after its chunk, wins) and delete it."""
    key = (CHUNKS.c.run_id, CHUNKS.c.rank, CHUNKS.c.name_id, CHUNKS.c.first_step)
    for chunk in bind.execute(sa.select(*key).order_by(*key)).all():
        where = [column == value for column, value in zip(key, chunk, strict=True)]
        run_id, rank_, nid, rows, steps, times, vals = bind.execute(
            sa.select(*(CHUNKS.c[c] for c in ("run_id", "rank", "name_id", "rows", *BLOBS))).where(*where)
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
        bind.execute(sa.delete(CHUNKS).where(*where))
