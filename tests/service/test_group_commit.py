"""Group commit of SQLite writers (service/store/group_commit.py): writers that queue behind one another share a
transaction, each batch in a savepoint; a failing batch loses only its own rows; a failure that ends the whole
transaction (a full disk) fails every member, so nothing is acknowledged that is not stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, LargeBinary, String, event, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from quantwatch.service import Settings
from quantwatch.service.core.db import make_engine, make_sessionmaker
from quantwatch.service.store.group_commit import MAX_GROUP, GroupCommit


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(Settings(database_url=f"sqlite:///{tmp_path / 'group.db'}"))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE rows (name TEXT PRIMARY KEY, payload BLOB)"))
    yield engine
    engine.dispose()


def _names(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return {row[0] for row in conn.execute(text("SELECT name FROM rows"))}


def _insert(name: str, size: int = 10) -> Callable[[Session], str]:
    def work(session: Session) -> str:
        session.execute(text("INSERT INTO rows VALUES (:n, zeroblob(:s))"), {"n": name, "s": size})
        return name

    return work


def _queued(group: GroupCommit, first: Callable[[Session], Any], others: list[Callable[[Session], Any]]) -> list[Any]:
    """Run ``first`` and, while it holds the slot, queue ``others`` behind it; each one's result or error."""
    release = threading.Event()

    def held(session: Session) -> Any:
        release.wait()
        return first(session)

    with ThreadPoolExecutor(len(others) + 1) as pool:
        futures: list[Future[Any]] = [pool.submit(group.run, held)]
        for work in others:
            futures.append(pool.submit(group.run, work))
        deadline = time.monotonic() + 60
        while group._waiting < len(others) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group._waiting == len(others)
        release.set()
        outcomes: list[Any] = []
        for future in futures:
            error = future.exception()
            outcomes.append(error if error is not None else future.result())
    return outcomes


def test_queued_writers_commit_together_and_a_failing_one_loses_only_its_rows(engine: Engine) -> None:
    commits: list[int] = []
    event.listen(engine, "commit", lambda _conn: commits.append(1))
    group = GroupCommit(make_sessionmaker(engine))

    def fails(session: Session) -> None:
        _insert("b")(session)
        raise ValueError("batch b is refused")

    outcomes = _queued(group, _insert("a"), [fails, _insert("c")])
    assert outcomes[0] == "a"
    assert outcomes[2] == "c"
    assert isinstance(outcomes[1], ValueError)
    assert _names(engine) == {"a", "c"}
    assert len(commits) == 1  # one transaction for the three writers


def test_a_full_disk_in_one_member_fails_the_members_before_it(engine: Engine) -> None:
    group = GroupCommit(make_sessionmaker(engine))

    def fills_the_disk(session: Session) -> None:
        pages = session.execute(text("PRAGMA page_count")).scalar_one()
        session.execute(text(f"PRAGMA max_page_count={pages + 1}"))
        _insert("big", 1 << 20)(session)

    outcomes = _queued(group, _insert("a"), [fills_the_disk])
    assert all(isinstance(outcome, OperationalError) for outcome in outcomes)
    assert "full" in str(outcomes[1])
    assert _names(engine) == set()
    engine.dispose()  # the pooled connection keeps its page limit
    assert group.run(_insert("after")) == "after"  # the next group starts afresh
    assert _names(engine) == {"after"}


def test_an_exclusive_writer_waits_for_the_open_group_and_runs_between_groups(engine: Engine) -> None:
    factory = make_sessionmaker(engine)
    group = GroupCommit(factory)
    seen: list[set[str]] = []

    def exclusive() -> None:
        with group.exclusive(), factory() as session:
            seen.append({row[0] for row in session.execute(text("SELECT name FROM rows"))})
            session.execute(text("INSERT INTO rows VALUES ('x', NULL)"))
            session.commit()

    release = threading.Event()

    def held(session: Session) -> str:
        release.wait()
        return _insert("a")(session)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(group.run, held)
        deadline = time.monotonic() + 60
        while not group._busy and time.monotonic() < deadline:
            time.sleep(0.01)
        other = pool.submit(exclusive)
        while not group._exclusive and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        assert first.result() == "a"
        other.result()
    assert seen == [{"a"}]  # it ran after the group had committed
    assert _names(engine) == {"a", "x"}


class _Base(DeclarativeBase):
    pass


class _Row(_Base):
    __tablename__ = "rows"
    name: Mapped[str] = mapped_column(String, primary_key=True)
    payload: Mapped[bytes | None] = mapped_column(LargeBinary)


def test_objects_a_failing_writer_added_are_neither_stored_nor_found_by_the_writers_after_it(engine: Engine) -> None:
    group = GroupCommit(make_sessionmaker(engine))
    refused = _Row(name="b", payload=b"refused")  # held here, so the session's weak identity map keeps it

    def adds_then_fails(session: Session) -> None:
        session.add(refused)
        session.flush()
        raise ValueError("batch b is refused")

    def adds_b_again(session: Session) -> bytes | None:
        assert session.get(_Row, "b") is None  # the rolled-back row is not in the identity map
        session.add(_Row(name="b", payload=b"kept"))
        return session.get(_Row, "b").payload  # type: ignore[union-attr]

    def adds(session: Session) -> str:
        session.add(_Row(name="a"))
        return "a"

    outcomes = _queued(group, adds, [adds_then_fails, adds_b_again])
    assert outcomes[0] == "a"
    assert isinstance(outcomes[1], ValueError)
    assert outcomes[2] == b"kept"
    with engine.connect() as conn:
        assert dict(conn.execute(text("SELECT name, payload FROM rows")).all()) == {"a": None, "b": b"kept"}


def test_every_member_runs_its_work_on_its_own_thread(engine: Engine) -> None:
    # Members take turns in the slot, each running its own work. The ingest observers keep nothing per thread
    # (IngestBatch.observed), so a leader could run the queued members' work itself (flat combining); tried, it held
    # the GIL for whole groups and cost 1-step ingest 4-11% of its requests/s side by side (issue 21).
    group = GroupCommit(make_sessionmaker(engine))

    def on_thread(name: str) -> Callable[[Session], int]:
        def work(session: Session) -> int:
            _insert(name)(session)
            return threading.get_ident()

        return work

    with ThreadPoolExecutor(4) as pool:
        callers = [pool.submit(lambda n=n: (threading.get_ident(), group.run(on_thread(n)))) for n in "abcd"]
        assert all(caller == worker for caller, worker in (f.result() for f in callers))
    assert _names(engine) == set("abcd")


def test_writers_beyond_a_full_group_commit_in_the_next_one(engine: Engine) -> None:
    commits: list[int] = []
    event.listen(engine, "commit", lambda _conn: commits.append(1))
    group = GroupCommit(make_sessionmaker(engine))
    names = [f"w{i}" for i in range(MAX_GROUP + 3)]
    outcomes = _queued(group, _insert("first"), [_insert(name) for name in names])
    assert outcomes == ["first", *names]
    assert _names(engine) == {"first", *names}
    assert len(commits) == 2  # MAX_GROUP in the first transaction, the rest led by the first writer left waiting


def test_a_writer_queued_behind_an_exclusive_transaction_runs_after_it(engine: Engine) -> None:
    factory = make_sessionmaker(engine)
    group = GroupCommit(factory)
    with ThreadPoolExecutor(1) as pool:
        with group.exclusive():
            queued = pool.submit(group.run, _insert("a"))
            deadline = time.monotonic() + 60
            while group._waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert group._waiting == 1
            with factory() as session:
                session.execute(text("INSERT INTO rows VALUES ('x', NULL)"))
                session.commit()
            assert not queued.done()
        assert queued.result() == "a"
    assert _names(engine) == {"a", "x"}
