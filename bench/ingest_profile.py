"""Where a small ingest batch's time goes (issue 21): ``Store.ingest`` in-process with the app's observers.

Builds the collector with ``create_app`` on ``--database-url`` (a fresh database), then stores ``--batches``
batches of ``--steps`` steps (every 25th) × 512 layers × 8 metrics in bench/ingest.py's binary encoding (healthy
values, 8 ranks in turn, the shipped rules), after 16 warm-up batches; with ``--scalars`` each step also carries the
catalogue's per-run scalars, as the agent's sampled steps carry theirs. Prints wall and CPU time per batch, the SQL
statements per batch and their time by kind (SQLAlchemy cursor events), and with ``--profile`` the cProfile listing
by cumulative time.

    PYTHONPATH=$PWD .venv/bin/python bench/ingest_profile.py --database-url sqlite:////tmp/p.db --profile
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import re
import time
from typing import Any

from _common import METRICS
from ingest import HEALTHY_SCALE, SAMPLE_EVERY, encode_batch, workload_values
from sqlalchemy import event

from quantwatch.service import Settings, create_app
from quantwatch.service.batch import decode_msgpack

RANKS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="run under cProfile and print the top 45 entries")
    parser.add_argument("--scalars", action="store_true", help="every step carries the catalogue's scalars")
    args = parser.parse_args()
    app = create_app(Settings(database_url=args.database_url))
    store, observers = app.state.store, list(app.state.ingest_observers)
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()

    def before(conn: Any, *_: Any) -> None:
        conn.info["started"] = time.perf_counter()

    def after(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        table = re.search(r"(INTO|FROM|UPDATE)\s+(\w+)", statement)
        kind = f"{statement.split()[0]} {table.group(2) if table else ''}"
        counts[kind] += 1
        seconds[kind] += time.perf_counter() - conn.info["started"]

    event.listen(store.engine, "before_cursor_execute", before)
    event.listen(store.engine, "after_cursor_execute", after)
    values = {rank: workload_values(rank, HEALTHY_SCALE) for rank in range(RANKS)}
    bodies = []
    for i in range(args.batches + 16):
        rank, first = i % RANKS, i // RANKS * args.steps * SAMPLE_EVERY
        steps = range(first, first + args.steps * SAMPLE_EVERY, SAMPLE_EVERY)
        body = encode_batch("prof", rank, steps, METRICS, values[rank], scalars=args.scalars)
        bodies.append(body)
    for body in bodies[:16]:
        store.ingest(decode_msgpack(body), observers)
    counts.clear()
    seconds.clear()
    profile = cProfile.Profile() if args.profile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    for body in bodies[16:]:
        store.ingest(decode_msgpack(body), observers)
    if profile is not None:
        profile.disable()
    n = args.batches
    wall, cpu = (time.perf_counter() - wall) / n * 1e3, (time.process_time() - cpu) / n * 1e3
    print(f"{n} batches: {wall:.2f} ms wall, {cpu:.2f} ms CPU per batch")
    for kind, count in counts.most_common():
        print(f"  {count / n:6.2f} statements {seconds[kind] / n * 1e3:8.3f} ms  {kind}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
