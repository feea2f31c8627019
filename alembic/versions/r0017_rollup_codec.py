"""Rollup blocks compressed: version 2 of their layout (issue 21).

No schema change. ``rollups.stats`` was one :data:`~quantwatch.service.rollups.STATS_DTYPE` record per layer; from
this revision it is a blob of ``quantwatch.service.rollup_codec`` (the records coded against each other, in byte
planes, deflated per group of layers: about half the bytes). The upgrade rewrites every stored block in the new
layout and the downgrade writes every one back in records, each with the layers it held (a block written before its
run grew stays as narrow as it was). Both decode what they rewrite to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import RowId
from quantwatch.service.rollup_codec import blob_layers, decode_blocks, encode_blocks
from quantwatch.service.rollups import STATS_DTYPE, Partials

revision: str = "0017_rollup_codec"
down_revision: str | None = "0016_alert_state_binary"

ROLLUPS = sa.table(
    "rollups",
    sa.column("run_id", RowId),
    sa.column("rank", sa.Integer()),
    sa.column("name_id", RowId),
    sa.column("level", sa.Integer()),
    sa.column("bucket", sa.BigInteger()),
    sa.column("stats", sa.LargeBinary()),
)
_KEY = ("run_id", "rank", "name_id", "level")


def _from_records(blob: bytes) -> bytes:
    """A block of records (the layout before this revision) in version 2."""
    layers = len(blob) // STATS_DTYPE.itemsize
    return encode_blocks(Partials.from_stats([blob], layers), [0])[0]


def _to_records(blob: bytes) -> bytes:
    """A block of version 2 as records."""
    return decode_blocks([blob], blob_layers(blob)).stats(0)


def _rewrite(convert: Callable[[bytes], bytes]) -> None:
    """Every stored block through ``convert``, one series (run, rank, metric, level) at a time."""
    bind = op.get_bind()
    change = (
        sa.update(ROLLUPS)
        .where(*(ROLLUPS.c[k] == sa.bindparam(f"k_{k}") for k in (*_KEY, "bucket")))
        .values(stats=sa.bindparam("blob"))
    )
    for series in bind.execute(sa.select(*(ROLLUPS.c[k] for k in _KEY)).distinct()).all():
        key = dict(zip(_KEY, series, strict=True))
        rows = bind.execute(
            sa.select(ROLLUPS.c.bucket, ROLLUPS.c.stats).where(*(ROLLUPS.c[k] == v for k, v in key.items()))
        ).all()
        params = [
            {**{f"k_{k}": v for k, v in key.items()}, "k_bucket": bucket, "blob": convert(bytes(stats))}
            for bucket, stats in rows
        ]
        if params:
            bind.execute(change, params)


def upgrade() -> None:
    _rewrite(_from_records)


def downgrade() -> None:
    _rewrite(_to_records)
