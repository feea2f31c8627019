"""Engines, sessions and migrations for SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from alembic import command
from quantwatch.service.core.config import Settings

# New SQLite files get 64 KiB pages: a 512-layer float32 blob row (~2 KiB) then packs ~31 to a page instead of one
# (4 KiB pages hold a single such row), which is what keeps storage near 4 bytes per point.
SQLITE_PAGE_SIZE = 65536
# Serialises concurrent `alembic upgrade` of several replicas starting at once on one PostgreSQL database.
MIGRATION_LOCK_KEY = 0x5157_0001


def is_sqlite(engine: Engine) -> bool:
    """True for a SQLite engine."""
    return engine.dialect.name == "sqlite"


def make_engine(settings: Settings) -> Engine:
    """Create the engine for ``settings.database_url`` with the per-backend connection setup."""
    url = settings.database_url
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60}, pool_use_lifo=True)
        synchronous = settings.sqlite_synchronous

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy's "begin" event below issue BEGIN itself (pysqlite's implicit BEGIN is deferred).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA cache_size=-131072")
            cur.execute("PRAGMA temp_store=MEMORY")
            # Reads map the file: every pooled connection shares the OS page cache instead of warming its own.
            cur.execute("PRAGMA mmap_size=4294967296")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # Writers take the write lock up front (BEGIN IMMEDIATE) so a transaction never fails upgrading a read
            # lock in WAL mode; busy_timeout then queues concurrent writers instead of erroring.
            mode = conn.get_execution_options().get("sqlite_begin", "")
            conn.exec_driver_sql(f"BEGIN {mode}".strip())

        return engine
    return create_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_pool_size,
        pool_pre_ping=True,
        pool_use_lifo=True,
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Session factory bound to ``engine`` (objects stay readable after commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def migrations_path() -> Path:
    """Folder of the Alembic scripts, found through the installed package (works from a wheel)."""
    return Path(str(resources.files("quantwatch.service") / "migrations"))


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_path()))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the migrations up to ``revision`` on ``engine`` (under an advisory lock on PostgreSQL)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        if not is_sqlite(engine):
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


@contextmanager
def write_session(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose transaction takes the SQLite write lock at BEGIN; commits on success, rolls back on error."""
    with factory() as session:
        session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
