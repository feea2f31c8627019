"""What several revisions create alike: the row id type, named foreign keys, tables of a run's rows.

Imported by the revisions as ``quantwatch.service.migrations.common`` (this folder ships inside the package; Alembic
loads only ``versions/*.py`` as revisions). Frozen like the revisions: an applied revision must keep creating exactly
what it created, so change nothing here that alters an existing revision's schema; add a helper instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from alembic import op

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def fk(table: str, column: str, target: str, ondelete: str | None = None) -> sa.ForeignKeyConstraint:
    """``table.column`` references ``target.id``; named ``fk_<table>_<column>_<target>``."""
    return sa.ForeignKeyConstraint([column], [f"{target}.id"], name=f"fk_{table}_{column}_{target}", ondelete=ondelete)


def run_table(table: str, *columns: sa.Column[Any], key: tuple[str, ...], metric: bool = False, **options: Any) -> None:
    """Create ``table`` of one run's rows: ``run_id`` and ``columns``, deleted with the run, keyed by the run and
    ``key``; with ``metric`` its ``name_id`` column references the metric names."""
    op.create_table(
        table,
        sa.Column("run_id", RowId, nullable=False),
        *columns,
        fk(table, "run_id", "runs", ondelete="CASCADE"),
        *([fk(table, "name_id", "metric_names")] if metric else []),
        sa.PrimaryKeyConstraint("run_id", *key, name=f"pk_{table}"),
        **options,
    )


def series_table(table: str, *columns: sa.Column[Any], key: tuple[str, ...], **options: Any) -> None:
    """Create ``table`` of one metric series' rows: (run, rank, metric name) and ``columns``, keyed by the series and
    ``key``."""
    run_table(table, rank(), name_id(), *columns, key=("rank", "name_id", *key), metric=True, **options)


def step_table(table: str, *columns: sa.Column[Any], key: tuple[str, ...]) -> None:
    """Create ``table`` of a step's rows on one rank of a run: (run, rank, step) and ``columns``, keyed by the step and
    ``key``."""
    run_table(table, rank(), step(), *columns, key=("rank", "step", *key))


def rank() -> sa.Column[Any]:
    """The column of a rank."""
    return sa.Column("rank", sa.Integer(), nullable=False)


def name_id() -> sa.Column[Any]:
    """The column of a metric name (``metric_names.id``)."""
    return sa.Column("name_id", RowId, nullable=False)


def step() -> sa.Column[Any]:
    """The column of a training step."""
    return sa.Column("step", sa.BigInteger(), nullable=False)


def run_name() -> sa.Column[Any]:
    """The column of a run's name, for the tables that hold runs by name (``run``)."""
    return sa.Column("run", sa.String(200), nullable=False)


def layer() -> sa.Column[Any]:
    """The column of a layer's name (``layer``)."""
    return sa.Column("layer", sa.String(500), nullable=False)


def refuse_ranks(refuse_while: str, why: str) -> None:
    """Raise RuntimeError in a downgrade when some rank matches the SQL condition ``refuse_while``: those ranks hold
    data the code below the revision cannot read right (``why`` says what, after their count)."""
    found = op.get_bind().execute(sa.text(f"SELECT count(*) FROM run_ranks WHERE {refuse_while}"))
    count = int(found.scalar_one())
    if count:
        raise RuntimeError(f"{count} run ranks {why}")


def drop_rank_column(column: str, refuse_while: str, why: str) -> None:
    """Drop ``run_ranks.column`` in a downgrade, or refuse (:func:`refuse_ranks`) while some rank matches
    ``refuse_while``."""
    refuse_ranks(refuse_while, why)
    with op.batch_alter_table("run_ranks") as batch:
        batch.drop_column(column)


SERIES_STATES = sa.table(
    "alert_series_states",
    sa.column("rule_id", sa.Integer()),
    sa.column("run", sa.String()),
    sa.column("rank", sa.Integer()),
    sa.column("series", sa.JSON()),
)
"""The alert series-state rows (revision 0009 on), as the revisions that rewrite their ``series`` read them."""


def rewrite_series_states(rewrite: Callable[[Any], Any | None]) -> None:
    """Store ``rewrite(series)`` in place of each alert series-state row's ``series`` (None: the row is kept)."""
    bind = op.get_bind()
    key = (SERIES_STATES.c.rule_id, SERIES_STATES.c.run, SERIES_STATES.c.rank)
    for rule_id, run, rank, series in bind.execute(sa.select(*key, SERIES_STATES.c.series)).all():
        rewritten = rewrite(series)
        if rewritten is not None:
            bind.execute(
                sa.update(SERIES_STATES)
                .where(key[0] == rule_id, key[1] == run, key[2] == rank)
                .values(series=rewritten)
            )
