"""Alembic environment: migrations run on the connection handed over by the collector, or on a URL."""

from __future__ import annotations

import os

from sqlalchemy import Connection, create_engine

from alembic import context
from quantwatch.service.alerts import tables  # noqa: F401  (puts the alert tables on Base.metadata)
from quantwatch.service.models import Base
from quantwatch.service.ranks import tables as rank_tables  # noqa: F401  (and the cross-rank ones)

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Use the connection the caller put in ``config.attributes`` or connect to the configured URL."""
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url") or os.environ.get(
        "QUANTWATCH_DATABASE_URL", "sqlite:///./quantwatch.db"
    )
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("QuantWatch migrations run online only: alembic upgrade head")
run_migrations_online()
