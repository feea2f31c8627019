"""Alert series states: one row per (rule, run, rank) holding every layer's series, instead of one row per series.

Every series of a rank advances at each sampled step, so a batch read and upserted one ``alert_series`` row per
(rule, layer): 512 per rule for a 512-layer model, the largest cost of a one-step batch (issue 21). A row of
``alert_series_states`` maps each layer to ``[status code, last_step, streak, clear_streak, last_value, baseline,
baseline_since]`` (status codes 0 inactive, 1 pending, 2 firing; trailing nulls left out) and a random ``token``
drawn at each write (0 for the rows carried over). Both directions carry the stored states over.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import fk

revision: str = "0009_alert_series_states"
down_revision: str | None = "0008_whatif"

STATUSES = ("inactive", "pending", "firing")
FIELDS = ("status", "last_step", "streak", "clear_streak", "last_value", "baseline", "baseline_since")
CHUNK = 1000

# name: (type, nullable); the leading (rule_id, run, rank[, layer]) columns are each table's primary key.
OLD_COLUMNS: dict[str, tuple[Any, bool]] = {
    "rule_id": (sa.Integer(), False),
    "run": (sa.String(200), False),
    "rank": (sa.Integer(), False),
    "layer": (sa.String(500), False),
    "status": (sa.String(16), False),
    "last_step": (sa.BigInteger(), True),
    "streak": (sa.Integer(), False),
    "clear_streak": (sa.Integer(), False),
    "last_value": (sa.Double(), True),
    "baseline": (sa.JSON(), True),
    "baseline_since": (sa.BigInteger(), True),
}
NEW_COLUMNS: dict[str, tuple[Any, bool]] = {
    "rule_id": (sa.Integer(), False),
    "run": (sa.String(200), False),
    "rank": (sa.Integer(), False),
    "token": (sa.BigInteger(), False),
    "series": (sa.JSON(), False),
}
OLD = sa.table("alert_series", *(sa.column(name, kind) for name, (kind, _) in OLD_COLUMNS.items()))
NEW = sa.table("alert_series_states", *(sa.column(name, kind) for name, (kind, _) in NEW_COLUMNS.items()))


def _create(table: str, columns: dict[str, tuple[Any, bool]], key: tuple[str, ...]) -> None:
    op.create_table(
        table,
        *(sa.Column(name, kind, nullable=nullable) for name, (kind, nullable) in columns.items()),
        sa.PrimaryKeyConstraint(*key, name=f"pk_{table}"),
        fk(table, "rule_id", "alert_rules", ondelete="CASCADE"),
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
    _create("alert_series_states", NEW_COLUMNS, ("rule_id", "run", "rank"))
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
    _create("alert_series", OLD_COLUMNS, ("rule_id", "run", "rank", "layer"))
    bind = op.get_bind()
    for chunk in _chunks(_unpacked(bind)):
        bind.execute(sa.insert(OLD), chunk)
    op.drop_table("alert_series_states")
