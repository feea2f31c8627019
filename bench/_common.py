"""What several benchmarks share: the metric names of the synthetic workload, a scratch PostgreSQL database, a
fresh migrated engine on either backend."""

import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from quantwatch.protocol import OVERVIEW_METRICS

# The metrics each layer of the synthetic runs reports, in wire order.
METRICS = list(OVERVIEW_METRICS)


@contextmanager
def postgres_database(prefix: str) -> Iterator[str]:
    """URL of a new, empty database on the test PostgreSQL server (``QUANTWATCH_TEST_POSTGRES_URL``), dropped after."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server = os.environ.get("QUANTWATCH_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    name = f"{prefix}_{os.getpid()}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def fresh_engine(backend: str, prefix: str) -> Iterator[Any]:
    """A collector engine on a new, migrated database (``backend`` ``sqlite``: a temporary file; else a scratch
    PostgreSQL database), disposed and removed after."""
    from quantwatch.service import Settings
    from quantwatch.service.core.db import make_engine, upgrade

    with ExitStack() as stack:
        if backend == "sqlite":
            url = f"sqlite:///{stack.enter_context(tempfile.TemporaryDirectory())}/{prefix}.db"
        else:
            url = stack.enter_context(postgres_database(prefix))
        engine = make_engine(Settings(database_url=url))
        stack.callback(engine.dispose)
        upgrade(engine)
        yield engine
