"""Group commit of concurrent ingest batches on SQLite (issue 21).

SQLite has one writer at a time: every ingest transaction held the database's write lock for its whole work and its
commit (an fsync with ``synchronous=FULL``), and the writers waiting for it slept in SQLite's busy handler, which wakes
them in no order (a p99 of seconds under load). Here the writers of one process queue in arrival order and one of
them, the leader, runs the queued batches one after the other in a single transaction: each batch inside a savepoint
of its own (a failing batch rolls back only its savepoint and gets its own error), batches that queue meanwhile join
(up to :data:`MAX_GROUP`), then the leader commits for the whole group. Every member returns only after that commit,
so an acknowledged batch is durable exactly as before; a failed commit fails every member (nothing of the group is
stored, each client retries).

The members sleep until their group is committed and are woken once each: handing a shared slot from thread to
thread per batch cost a wake-up (a context switch on a loaded machine, with the GIL held) per member and hand-off,
about a fifth of a one-step batch's time. Once its group is committed the leader hands the lead to the first writer
queued behind it, so a writer's latency is bounded by its own group's.

Other writers of the process (rollup compaction, run deletion) take the slot :meth:`GroupCommit.exclusive`ly, between
groups; writers of other processes queue on SQLite's lock as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")

MAX_GROUP = 32
"""Batches one transaction takes at most: a writer of another process gets the lock between groups."""

_SAVEPOINT = "SAVEPOINT qw_batch"
_RELEASE = "RELEASE SAVEPOINT qw_batch"
_ROLLBACK = "ROLLBACK TO SAVEPOINT qw_batch"


class _Member(Generic[T]):
    """One queued batch: its work, its outcome, and the lock it sleeps on until it is led or its group is done."""

    __slots__ = ("work", "result", "error", "finished", "wake")

    def __init__(self, work: Callable[[Session], T]) -> None:
        self.work = work
        self.result: T | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.wake = threading.Lock()
        self.wake.acquire()


class GroupCommit:
    """The write slot of one process's SQLite writers (see the module's docstring)."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self._lock = threading.Lock()
        self._exclusives = threading.Condition(self._lock)
        self._pending: list[_Member[Any]] = []
        self._leading = False
        self._exclusive = 0
        self._busy = False

    def run(self, work: Callable[[Session], T]) -> T:
        """``work(session)`` in a savepoint of a group transaction (run by whichever writer leads the group); returns
        its result once the group committed. Raises ``work``'s own error (its savepoint rolled back), or the
        commit's error."""
        member = _Member(work)
        with self._lock:
            self._pending.append(member)
            lead = not (self._leading or self._busy or self._exclusive)
            self._leading = self._leading or lead
        while not member.finished:
            if lead:
                self._lead()
            member.wake.acquire()
            lead = not member.finished  # woken without an outcome: the lead was handed to this writer
        if member.error is not None:
            raise member.error
        return member.result  # type: ignore[return-value]

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the slot with no group open, for a transaction of the caller's own."""
        with self._lock:
            self._exclusive += 1
            while self._leading or self._busy:
                self._exclusives.wait()
            self._exclusive -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._lock:
                self._busy = False
                self._pass_on()

    def _lead(self) -> None:
        """Run the queued writers (and those that queue meanwhile) in one transaction, commit it, pass the slot on."""
        group = self._join(0)
        session = self.factory()
        broken: BaseException | None = None
        try:
            session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
        except BaseException as exc:
            broken = exc
        joining = group
        while broken is None and joining:
            for member in joining:
                broken = _run_member(session, member)
                if broken is not None:
                    break
            else:
                joining = self._join(len(group))
                group.extend(joining)
        try:
            if broken is not None:
                raise broken
            session.commit()
        except BaseException as exc:
            for member in group:  # a broken transaction or a failed commit: nothing of the group is stored
                if member.error is None or broken is not None:
                    member.error = exc
            with suppress(Exception):
                session.rollback()
        finally:
            session.close()
            with self._lock:
                self._leading = False
                self._pass_on()
            for member in group:
                member.finished = True
                member.wake.release()

    def _join(self, size: int) -> list[_Member[Any]]:
        """The queued writers that join a group of ``size`` (none once an exclusive writer waits for the slot)."""
        with self._lock:
            if size and self._exclusive:
                return []
            joining = self._pending[: MAX_GROUP - size]
            del self._pending[: len(joining)]
        return joining

    def _pass_on(self) -> None:
        """With the slot free (lock held): wake an exclusive writer first, else hand the lead to the first queued."""
        if self._busy or self._leading:
            return
        if self._exclusive:
            self._exclusives.notify()
        elif self._pending:
            self._leading = True
            self._pending[0].wake.release()


def _run_member(session: Session, member: _Member[Any]) -> BaseException | None:
    """Run ``member``'s work in a savepoint; the error that broke the whole transaction, if one did.

    The savepoint is SQLite's own, not the session's ``begin_nested``: SQLAlchemy's nested transaction cost twice the
    statements it wraps (its bookkeeping, and a SAVEPOINT emitted on the first use of the connection) — about a tenth
    of a one-step batch's time. The session is flushed inside the savepoint, and after a rollback to it every object
    is expunged: the rolled-back work's objects must be neither flushed later nor found again by identity."""
    conn = session.connection()
    conn.exec_driver_sql(_SAVEPOINT)
    try:
        member.result = member.work(session)
        session.flush()
        conn.exec_driver_sql(_RELEASE)
    except BaseException as exc:
        member.error = exc
        try:
            intact = session.is_active and _intact(session)
            if intact:
                conn.exec_driver_sql(_ROLLBACK)
                conn.exec_driver_sql(_RELEASE)
                session.expunge_all()
        except Exception:
            intact = False
        if not intact:
            # SQLite rolled the whole transaction back (a full disk, an I/O error), or a failed flush did: the members
            # before this one lost their writes too, so the group must not commit.
            return exc
    return None


def _intact(session: Session) -> bool:
    """Whether the session's SQLite transaction is still open."""
    try:
        return bool(session.connection().connection.dbapi_connection.in_transaction)  # type: ignore[union-attr]
    except Exception:
        return False
