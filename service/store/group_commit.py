"""Group commit of concurrent ingest batches on SQLite (issue 21).

SQLite has one writer at a time: every ingest transaction held the database's write lock for its whole work and its
commit (an fsync with ``synchronous=FULL``), and the writers waiting for it slept in SQLite's busy handler, which wakes
them in no order (a p99 of seconds under load). Here the writers of one process queue for one slot instead, in arrival
order, and share one transaction: whoever finds the slot free leads a group, opens the transaction, runs its own work
and then the work of every writer queued behind it (each in a savepoint of its own: a failing batch rolls back only
its savepoint and its writer gets the error at once), commits for the whole group, and wakes each member with its
result. Every member returns only after that commit, so an acknowledged batch is durable exactly as before; a failed
commit fails every member (nothing of the group is stored, each client retries).

The leader runs the members' work on its own thread (flat combining): a member sleeps once, until its group
committed, instead of also waiting for its turn in the slot; each such hand-over between threads cost a one-step
request a context switch, which on a busy machine often also cost the thread holding the GIL its core. The work must
therefore keep nothing per thread between the group and the caller (see ``IngestBatch.observed``). A writer that
queued behind a full group (``MAX_GROUP``) or arrived during a commit is woken to lead the next group.

Other writers of the process (rollup compaction, run deletion) take the slot :meth:`GroupCommit.exclusive`ly, between
groups; writers of other processes queue on SQLite's lock as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Generic, TypeVar

from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")

MAX_GROUP = 32
"""Batches one transaction takes at most: a writer of another process gets the lock between groups."""

_SAVEPOINT = "SAVEPOINT qw_batch"
_RELEASE = "RELEASE SAVEPOINT qw_batch"
_ROLLBACK = "ROLLBACK TO SAVEPOINT qw_batch"


class _Member(Generic[T]):
    """One writer's work, and its outcome once its group is done (or the call to lead the next group)."""

    def __init__(self, work: Callable[[Session], T]) -> None:
        self.work = work
        self.result: T | None = None
        self.error: BaseException | None = None
        self.lead = False
        self.finished = False
        self.done = threading.Event()

    def finish(self, error: BaseException | None) -> None:
        """Give the member its outcome (its result is set already) and wake it."""
        if error is not None:
            self.error = error
        self.finished = True
        self.done.set()


class _Group:
    """One open transaction and whether a member's failure ended it (nothing of the group may commit then)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.members: list[_Member[object]] = []
        self.broken: BaseException | None = None


class GroupCommit:
    """The write slot of one process's SQLite writers (see the module's docstring)."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        lock = threading.Lock()
        self._lock = lock
        self._exclusives = threading.Condition(lock)
        self._busy = False
        self._queue: deque[_Member[object]] = deque()
        self._exclusive = 0

    @property
    def _waiting(self) -> int:
        """Writers queued for the next group."""
        return len(self._queue)

    def run(self, work: Callable[[Session], T]) -> T:
        """``work(session)`` in a savepoint of a group transaction (perhaps on the group leader's thread); returns
        its result once the group committed. Raises ``work``'s own error at once (its savepoint rolled back), or the
        commit's error."""
        member: _Member[T] = _Member(work)
        with self._lock:
            lead = not self._busy and not self._exclusive
            if lead:
                self._busy = True
            else:
                self._queue.append(member)  # type: ignore[arg-type]
        if not lead:
            member.done.wait()
            lead = member.lead
        if lead:
            self._lead(member)  # type: ignore[arg-type]
        if member.error is not None:
            raise member.error
        return member.result  # type: ignore[return-value]

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the slot with no group open, for a transaction of the caller's own."""
        with self._lock:
            self._exclusive += 1
            while self._busy:
                self._exclusives.wait()
            self._exclusive -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._lock:
                self._hand_over()

    def _lead(self, first: _Member[object]) -> None:
        """Run a group: ``first`` and the members queued behind it, up to ``MAX_GROUP`` (fewer when an exclusive
        writer waits), in one transaction; then finish every member and hand the slot over."""
        group = _Group(self.factory())
        try:
            group.session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
        except BaseException as exc:
            group.broken = exc
        member: _Member[object] | None = first
        while member is not None:
            group.members.append(member)
            self._member(group, member)
            with self._lock:
                member = (
                    self._queue.popleft()
                    if self._queue and group.broken is None and not self._exclusive and len(group.members) < MAX_GROUP
                    else None
                )
        self._commit(group)
        with self._lock:
            self._hand_over()

    @staticmethod
    def _member(group: _Group, member: _Member[object]) -> None:
        """``member``'s work in a savepoint of SQLite's own, not the session's ``begin_nested``: SQLAlchemy's nested
        transaction cost about twice the statements it wraps (its bookkeeping, and a SAVEPOINT emitted on the first
        use of the connection), ~8% of a one-step request's time. So the session is flushed inside the savepoint, and
        after a rollback to it every object is expunged: the rolled-back work's objects must be neither flushed later
        nor found again by identity; a failed flush (it rolls the session's transaction back) breaks the group. A
        member whose own work failed, its savepoint rolled back, is finished with its error at once."""
        if group.broken is not None:
            member.error = group.broken
            return
        session = group.session
        try:
            conn = session.connection()
            conn.exec_driver_sql(_SAVEPOINT)
        except BaseException as exc:
            group.broken = member.error = exc
            return
        try:
            member.result = member.work(session)
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
            if intact:
                member.finish(exc)
            else:
                member.error = exc

    @staticmethod
    def _commit(group: _Group) -> None:
        """Commit the group (or roll it back when broken) and finish its members with the outcome."""
        error = group.broken
        try:
            if error is None:
                group.session.commit()
        except BaseException as exc:
            error = exc
            with suppress(Exception):
                group.session.rollback()
        finally:
            group.session.close()
        for member in group.members:
            if not member.finished:  # a member whose own work failed has its error already
                member.finish(error)

    def _hand_over(self) -> None:
        """With the caller's group done or its exclusive transaction over: wake an exclusive writer first, else make
        the first queued writer the next leader, else free the slot. The lock is held."""
        if self._exclusive:
            self._busy = False
            self._exclusives.notify()
        elif self._queue:
            member = self._queue.popleft()
            member.lead = True
            member.done.set()
        else:
            self._busy = False


def _intact(session: Session) -> bool:
    """Whether the session's SQLite transaction is still open."""
    try:
        return bool(session.connection().connection.dbapi_connection.in_transaction)  # type: ignore[union-attr]
    except Exception:
        return False
