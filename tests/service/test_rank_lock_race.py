"""A batch that waited for its rank's write lock sees the layers that a batch of the same rank added meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from sqlalchemy import text

from quantwatch.service.batch import batch_from_obj
from quantwatch.service.store import Store


@contextmanager
def _rank_lock_held(store: Store, run_id: int, rank: int) -> Iterator[Callable[[int], None]]:
    """Hold the lock an ingest of (run, rank) waits for; yields ``wait_for(n)``: block until n ingests queue on it."""
    with store.engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn:
        if store.pg:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": Store._rank_key(run_id, rank)})
        else:
            conn.execute(text("SELECT 1"))  # BEGIN IMMEDIATE: the SQLite write lock every ingest waits for

        def wait_for(n: int) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if not store.pg:
                    time.sleep(0.3)  # SQLite shows no lock queue; its writers poll the busy handler
                    return
                with store.engine.connect() as probe:
                    waiting = probe.execute(
                        text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                    ).scalar_one()
                if waiting >= n:
                    return
                time.sleep(0.02)
            raise TimeoutError(f"{n} ingests never queued on the rank lock")

        yield wait_for
        conn.rollback()


def test_batch_waiting_on_rank_lock_sees_layers_added_meanwhile(
    make_app: Callable[..., Any], make_batch: Callable[..., Any]
) -> None:
    store: Store = make_app().state.store
    rng = np.random.default_rng(5)

    def batch(layers: list[str], steps: list[int]) -> Any:
        values = rng.random((len(steps), len(layers)), dtype=np.float32)
        return batch_from_obj(make_batch("race", layers, steps, {"m": values}, binary=True)), values

    first, first_values = batch(["a", "b"], [0, 1])
    store.ingest(first)
    widening, widening_values = batch(["a", "b", "c"], [2, 3])  # queued first: adds layer "c"
    stale, stale_values = batch(["a", "b"], [4, 5])  # queued second: read the run while it had two layers
    errors: list[BaseException] = []

    def ingest(b: Any) -> None:
        try:
            store.ingest(b)
        except BaseException as exc:
            errors.append(exc)

    with _rank_lock_held(store, store.run_id("race"), 0) as wait_for:
        threads = [threading.Thread(target=ingest, args=(b,)) for b in (widening, stale)]
        threads[0].start()
        wait_for(1)
        threads[1].start()
        wait_for(2)
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    heat = store.heatmap("race", "m", rank=0, start=None, end=None, max_steps=100, agg="max", layers=None)
    assert heat["layers"] == ["a", "b", "c"]
    got = np.array([[np.nan if v is None else v for v in row] for row in heat["values"]], dtype=np.float32)
    want = np.full((3, 6), np.nan, dtype=np.float32)
    want[:2, 0:2] = first_values.T
    want[:, 2:4] = widening_values.T
    want[:2, 4:6] = stale_values.T
    np.testing.assert_array_equal(got, want)
