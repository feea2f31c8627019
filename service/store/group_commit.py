"""Group commit of concurrent ingest batches on SQLite (issue 21).

SQLite has one writer at a time: every ingest transaction held the database's write lock for its whole work and its
commit (an fsync with ``synchronous=FULL``), and the writers waiting for it slept in SQLite's busy handler, which wakes
them in no order (a p99 of seconds under load). Here the writers of one process take turns through a slot instead,
in arrival order, and share one transaction: the first opens it, each batch runs inside a savepoint of its own (a
failing batch rolls back only its savepoint and gets its error at once), and whoever finds nobody waiting behind it
commits for the whole group. Every member returns only after that commit, so an acknowledged batch is durable
exactly as before; a failed commit fails every member (nothing of the group is stored, each client retries).

Other writers of the process (rollup compaction, run deletion) take the slot :meth:`GroupCommit.exclusive`ly, between
groups; writers of other processes queue on SQLite's lock as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")

MAX_GROUP = 32
"""Batches one transaction takes at most: a writer of another process gets the lock between groups."""

_SAVEPOINT = "SAVEPOINT qw_batch"
_RELEASE = "RELEASE SAVEPOINT qw_batch"
_ROLLBACK = "ROLLBACK TO SAVEPOINT qw_batch"


class _Group:
    """One open transaction and the outcome its members wait for."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.members = 0
        self.broken: BaseException | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class GroupCommit:
    """The write slot of one process's SQLite writers (see the module's docstring)."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        lock = threading.Lock()
        # Two conditions on one lock: a release wakes one waiter that can go on, not every thread queued.
        self._writers = threading.Condition(lock)
        self._exclusives = threading.Condition(lock)
        self._busy = False
        self._open: _Group | None = None
        self._waiting = 0
        self._exclusive = 0

    def run(self, work: Callable[[Session], T]) -> T:
        """``work(session)`` in a savepoint of the group transaction; returns its result once the group committed.
        Raises ``work``'s own error at once (its savepoint rolled back), or the commit's error."""
        group = self._take()
        try:
            result = self._member(group, work)
        finally:
            self._give_back(group)
        group.wait()
        return result

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the slot with no group open, for a transaction of the caller's own."""
        with self._writers:
            self._exclusive += 1
            while self._busy or self._open is not None:
                self._exclusives.wait()
            self._exclusive -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._writers:
                self._busy = False
                self._wake_one()

    def _take(self) -> _Group:
        """Wait for the slot; the group to join (opened here when none is)."""
        with self._writers:
            self._waiting += 1
            while self._busy or (self._exclusive and self._open is None):
                self._writers.wait()
            self._waiting -= 1
            self._busy = True
            group, self._open = self._open, None
        if group is None:
            group = _Group(self.factory())
            try:
                group.session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            except BaseException as exc:
                group.broken = exc
        return group

    @staticmethod
    def _member(group: _Group, work: Callable[[Session], T]) -> T:
        """``work`` in a savepoint of SQLite's own, not the session's ``begin_nested``: SQLAlchemy's nested
        transaction cost about twice the statements it wraps (its bookkeeping, and a SAVEPOINT emitted on the first
        use of the connection), ~8% of a one-step request's time. So the session is flushed inside the savepoint, and
        after a rollback to it every object is expunged: the rolled-back work's objects must be neither flushed later
        nor found again by identity; a failed flush (it rolls the session's transaction back) breaks the group."""
        if group.broken is not None:
            raise group.broken
        group.members += 1
        session = group.session
        conn = session.connection()
        conn.exec_driver_sql(_SAVEPOINT)
        try:
            result = work(session)
            session.flush()
            conn.exec_driver_sql(_RELEASE)
        except BaseException as exc:
            try:
                intact = session.is_active and _intact(session)
                if intact:
                    conn.exec_driver_sql(_ROLLBACK)
                    conn.exec_driver_sql(_RELEASE)
                    session.expunge_all()
            except Exception:
                intact = False
            if not intact:
                # SQLite rolled the whole transaction back (a full disk, an I/O error), or a failed flush did: the
                # members before this one lost their writes too, so the group must not commit.
                group.broken = exc
            raise
        return result

    def _give_back(self, group: _Group) -> None:
        """Leave the group open for the next writer waiting, or commit it (or roll it back when broken)."""
        with self._writers:
            if group.broken is None and self._waiting and not self._exclusive and group.members < MAX_GROUP:
                self._open = group
                self._busy = False
                self._writers.notify()
                return
        try:
            if group.broken is not None:
                raise group.broken
            group.session.commit()
        except BaseException as exc:
            group.error = exc
            with suppress(Exception):
                group.session.rollback()
        finally:
            group.session.close()
            group.done.set()
            with self._writers:
                self._busy = False
                self._wake_one()

    def _wake_one(self) -> None:
        """With the slot free and no group open: wake an exclusive writer first, else a batch writer."""
        if self._exclusive:
            self._exclusives.notify()
        else:
            self._writers.notify()


def _intact(session: Session) -> bool:
    """Whether the session's SQLite transaction is still open."""
    try:
        return bool(session.connection().connection.dbapi_connection.in_transaction)  # type: ignore[union-attr]
    except Exception:
        return False
