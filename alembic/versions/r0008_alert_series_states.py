"""Alert series states: one row per (rule, run, rank) holding every layer's series, instead of one row per series.

Every series of a rank advances at each sampled step, so a batch read and upserted one ``alert_series`` row per
(rule, layer): 512 per rule for a 512-layer model, the largest cost of a one-step batch (issue 21). A row of
``alert_series_states`` maps each layer to ``[status code, last_step, streak, clear_streak, last_value, baseline,
baseline_since]`` (status codes 0 inactive, 1 pending, 2 firing; trailing nulls left out) and a random ``token``
drawn at each write (0 for the rows carried over). Both directions carry the stored states over.

Revision ID: 0008_alert_series_states
Revises: 0007_rollup_frontier
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from alembic import op

revision: str = "0008_alert_series_states"
down_revision: str | None = "0007_rollup_frontier"

STATUSES = ("inactive", "pending", "firing")
FIELDS = ("status", "last_step", "streak", "clear_streak", "last_value", "baseline", "baseline_since")
CHUNK = 1000

OLD = sa.table(
    "alert_series",
    sa.column("rule_id", sa.Integer()),
    sa.column("run", sa.String()),
    sa.column("rank", sa.Integer()),
    sa.column("layer", sa.String()),
    sa.column("status", sa.String()),
    sa.column("last_step", sa.BigInteger()),
    sa.column("streak", sa.Integer()),
    sa.column("clear_streak", sa.Integer()),
    sa.column("last_value", sa.Double()),
    sa.column("baseline", sa.JSON()),
    sa.column("baseline_since", sa.BigInteger()),
)
NEW = sa.table(
    "alert_series_states",
    sa.column("rule_id", sa.Integer()),
    sa.column("run", sa.String()),
    sa.column("rank", sa.Integer()),
    sa.column("token", sa.BigInteger()),
    sa.column("series", sa.JSON()),
)


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["rule_id"], ["alert_rules.id"], name=f"fk_{table}_rule_id_alert_rules", ondelete="CASCADE"
    )


def _chunks(rows: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _packed(bind: sa.Connection) -> Iterator[dict[str, Any]]:
    """The old rows of each (rule, run, rank) as one new row."""
    key: tuple[int, str, int] | None = None
    series: dict[str, list[Any]] = {}
    query = sa.select(OLD.c.rule_id, OLD.c.run, OLD.c.rank, OLD.c.layer, *(OLD.c[name] for name in FIELDS))
    for rule_id, run, rank, layer, status, last_step, streak, clear, value, baseline, since in bind.execute(
        query.order_by(OLD.c.rule_id, OLD.c.run, OLD.c.rank)
    ):
        if key != (rule_id, run, rank):
            if key is not None:
                yield {"rule_id": key[0], "run": key[1], "rank": key[2], "token": 0, "series": series}
            key, series = (rule_id, run, rank), {}
        fields = [STATUSES.index(status), last_step, streak, clear, value, baseline or None, since]
        while fields[-1] is None:
            fields.pop()
        series[layer] = fields
    if key is not None:
        yield {"rule_id": key[0], "run": key[1], "rank": key[2], "token": 0, "series": series}


def upgrade() -> None:
    op.create_table(
        "alert_series_states",
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("run", sa.String(200), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("series", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("rule_id", "run", "rank", name="pk_alert_series_states"),
        _fk("alert_series_states"),
    )
    bind = op.get_bind()
    for chunk in _chunks(_packed(bind)):
        bind.execute(sa.insert(NEW), chunk)
    op.drop_table("alert_series")


def _unpacked(bind: sa.Connection) -> Iterator[dict[str, Any]]:
    for rule_id, run, rank, series in bind.execute(sa.select(NEW.c.rule_id, NEW.c.run, NEW.c.rank, NEW.c.series)):
        for layer, stored in series.items():
            values = dict(zip(FIELDS, (*stored, *(None,) * (len(FIELDS) - len(stored))), strict=True))
            values["status"] = STATUSES[values["status"]]
            yield {"rule_id": rule_id, "run": run, "rank": rank, "layer": layer, **values}


def downgrade() -> None:
    op.create_table(
        "alert_series",
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("run", sa.String(200), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("layer", sa.String(500), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("streak", sa.Integer(), nullable=False),
        sa.Column("clear_streak", sa.Integer(), nullable=False),
        sa.Column("last_value", sa.Double(), nullable=True),
        sa.Column("baseline", sa.JSON(), nullable=True),
        sa.Column("baseline_since", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("rule_id", "run", "rank", "layer", name="pk_alert_series"),
        _fk("alert_series"),
    )
    bind = op.get_bind()
    for chunk in _chunks(_unpacked(bind)):
        bind.execute(sa.insert(OLD), chunk)
    op.drop_table("alert_series_states")
