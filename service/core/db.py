"""Engines, sessions and migrations for SQLite and PostgreSQL, and what to say when the database cannot write."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from alembic import command
from quantwatch.service.core.config import Settings

# New SQLite files get 64 KiB pages: a 512-layer float32 blob row (~2 KiB) then packs ~31 to a page instead of one
# (4 KiB pages hold a single such row), which is what keeps storage near 4 bytes per point.
SQLITE_PAGE_SIZE = 65536
# Serialises concurrent `alembic upgrade` of several replicas starting at once on one PostgreSQL database.
MIGRATION_LOCK_KEY = 0x5157_0001
# How long a SQLite writer queues for the write lock before "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 60000
log = logging.getLogger("quantwatch.service")


def is_sqlite(engine: Engine) -> bool:
    """True for a SQLite engine."""
    return engine.dialect.name == "sqlite"


def dump_json(value: Any) -> str:
    """The text of a JSON column's value: orjson, ~10× the standard library's speed on the alert states a batch
    rewrites (512 layers' fields per rule). Non-string keys are written as strings, as ``json.dumps`` does; NaN and
    ±inf, which no JSON column holds (PostgreSQL's ``json`` refuses them), would be written as null."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def make_engine(settings: Settings) -> Engine:
    """Create the engine for ``settings.database_url`` with the per-backend connection setup."""
    url = settings.database_url
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 60},
            pool_use_lifo=True,
            json_serializer=dump_json,
        )
        synchronous = settings.sqlite_synchronous

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy's "begin" event below issue BEGIN itself (pysqlite's implicit BEGIN is deferred).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
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
        json_serializer=dump_json,
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


@dataclass(frozen=True)
class DatabaseProblem:
    """Why the database cannot take a write right now: a ``cause`` slug (:data:`DATABASE_CAUSES`) and one line
    saying it, with the database's own words."""

    cause: str
    detail: str


#: Causes a database failure is classified as, with the sentence operators read.
DATABASE_CAUSES = {
    "disk-full": "the database's disk is full",
    "read-only": "the database is read-only",
    "locked": "the database is locked by another writer",
    "unreachable": "the database cannot be reached or opened",
    "unavailable": "the database is unavailable",
}
_SQLITE_CAUSES = {
    "SQLITE_FULL": "disk-full",
    "SQLITE_READONLY": "read-only",
    "SQLITE_BUSY": "locked",
    "SQLITE_LOCKED": "locked",
    "SQLITE_CANTOPEN": "unreachable",
    "SQLITE_NOTADB": "unreachable",
}
# PostgreSQL SQLSTATEs (Appendix A of its manual): class 53 insufficient resources, 25006 read-only transaction,
# 55P03 lock not available, 57P0x the server shutting down or starting, class 08 connection exceptions.
_SQLSTATE_CAUSES = {"53100": "disk-full", "25006": "read-only", "55P03": "locked", "40P01": "locked"}
_ERRNO_CAUSES = {errno.ENOSPC: "disk-full", errno.EDQUOT: "disk-full", errno.EROFS: "read-only"}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def describe_database_error(exc: BaseException) -> DatabaseProblem | None:
    """Classify a failure of the database (SQLAlchemy's wrapper, a driver error or an OSError) as disk full,
    read-only, locked, unreachable or unavailable; None when it is not one (a bug, a constraint violation)."""
    orig: BaseException = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    cause: str | None = None
    if isinstance(orig, OSError):
        cause = _ERRNO_CAUSES.get(orig.errno or 0, "unreachable")
    elif isinstance(orig, sqlite3.Error):
        name = getattr(orig, "sqlite_errorname", "") or ""
        cause = next((c for prefix, c in _SQLITE_CAUSES.items() if name.startswith(prefix)), None)
        if cause is None and name.startswith("SQLITE_IOERR"):
            cause = "disk-full" if "full" in str(orig).lower() else "unavailable"
    else:
        sqlstate = getattr(orig, "sqlstate", None)
        if isinstance(sqlstate, str):
            cause = _SQLSTATE_CAUSES.get(sqlstate)
            if cause is None and sqlstate.startswith(("08", "57P")):
                cause = "unreachable"
            if cause is None and sqlstate.startswith("53"):
                cause = "unavailable"
    if cause is None and isinstance(exc, OperationalError):
        cause = "unreachable" if "connect" in str(orig).lower() else "unavailable"
    if cause is None:
        return None
    return DatabaseProblem(cause, f"{DATABASE_CAUSES[cause]} ({_first_line(orig)})")


def probe_writes(engine: Engine) -> DatabaseProblem | None:
    """A cheap check that the database takes writes, all rolled back: on SQLite a no-op update of the schema
    version (fails on a read-only file), the pages left under ``max_page_count`` and the bytes left on the file's
    filesystem; on PostgreSQL a transaction id (fails on a read-only server or a standby).  None when fine.

    A write lock held past the probe's one-second wait is not reported: the collector's own ingest holds it for as
    long as a large batch takes, and a lock that outlasts the writers' minute reaches ``/readyz`` through
    :class:`WriteHealth` instead."""
    try:
        with engine.connect() as conn:
            transaction = conn.begin()
            try:
                return _probe(engine, conn)
            finally:
                transaction.rollback()
    except (SQLAlchemyError, OSError) as exc:
        problem = describe_database_error(exc) or DatabaseProblem("unavailable", _first_line(exc))
        return None if problem.cause == "locked" else problem


def _probe(engine: Engine, conn: Connection) -> DatabaseProblem | None:
    if not is_sqlite(engine):
        conn.execute(text("SELECT txid_current()"))
        return None
    conn.exec_driver_sql("PRAGMA busy_timeout=1000")
    try:
        conn.execute(text("UPDATE alembic_version SET version_num = version_num"))
    finally:
        conn.exec_driver_sql(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    page_size, pages, max_pages, free_pages = (
        int(conn.exec_driver_sql(f"PRAGMA {name}").scalar_one())
        for name in ("page_size", "page_count", "max_page_count", "freelist_count")
    )
    if pages >= max_pages and free_pages == 0:
        return DatabaseProblem("disk-full", f"{DATABASE_CAUSES['disk-full']} (max_page_count {max_pages} reached)")
    path = engine.url.database
    if path and path != ":memory:" and not path.startswith("file:"):
        stat = os.statvfs(Path(path).resolve().parent)
        free = stat.f_bavail * stat.f_frsize
        if free < page_size:
            return DatabaseProblem("disk-full", f"{DATABASE_CAUSES['disk-full']} ({free} bytes free)")
    return None


class WriteHealth:
    """The collector's memory of its last failed database write, until a write succeeds or ``hold_seconds`` pass
    without another failure (so ``/readyz`` stays 503 while ingest cannot store, also where no probe can tell, as
    a full disk on PostgreSQL).  Each change is logged as one line.  Thread-safe."""

    def __init__(self, hold_seconds: float = 30.0) -> None:
        self.hold_seconds = hold_seconds
        self._lock = threading.Lock()
        self._problem: DatabaseProblem | None = None
        self._at = 0.0

    def failed(self, problem: DatabaseProblem) -> None:
        """A write failed for ``problem``; logged when the cause is new."""
        with self._lock:
            new = self._problem is None or self._problem.cause != problem.cause
            self._problem, self._at = problem, time.monotonic()
        if new:
            log.error("database cannot take writes: %s", problem.detail)

    def succeeded(self) -> None:
        """A write was stored: forget the failure (logged once)."""
        if self._problem is None:  # the common case, without the lock
            return
        with self._lock:
            cleared, self._problem = self._problem, None
        if cleared is not None:
            log.warning("database takes writes again (after: %s)", cleared.cause)

    def current(self) -> DatabaseProblem | None:
        """The remembered failure, if a write failed within ``hold_seconds``."""
        with self._lock:
            if self._problem is not None and time.monotonic() - self._at < self.hold_seconds:
                return self._problem
            return None
