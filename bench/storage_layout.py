"""Narrow rows versus float32 blobs on SQLite: the measurement behind README "Storage" (issue 3).

Writes the same points (512 layers × 8 metrics per step) both ways into fresh SQLite files (WAL, synchronous=FULL,
one transaction per 16-step batch, like the collector) and prints points/s and bytes per point.

    .venv/bin/python bench/storage_layout.py [--steps 256]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

LAYERS, METRICS, BATCH_STEPS = 512, 8, 16


def connect(path: Path, page_size: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"PRAGMA page_size={page_size}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def size(path: Path, conn: sqlite3.Connection) -> int:
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


Row = tuple[object, ...]


def write_batches(
    path: Path, conn: sqlite3.Connection, steps: int, insert: str, rows: Callable[[range], list[Row]]
) -> tuple[float, float]:
    """Insert ``rows(batch_steps)`` one transaction per batch, like the collector; points/s and bytes per point."""
    t0 = time.perf_counter()
    for s0 in range(0, steps, BATCH_STEPS):
        batch = rows(range(s0, s0 + BATCH_STEPS))
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(insert, batch)
        conn.execute("COMMIT")
    rate = steps * LAYERS * METRICS / (time.perf_counter() - t0)
    return rate, size(path, conn) / (steps * LAYERS * METRICS)


def narrow(path: Path, values: np.ndarray, steps: int) -> tuple[float, float]:
    conn = connect(path, 4096)
    conn.execute(
        "CREATE TABLE p (run INTEGER, rank INTEGER, layer INTEGER, metric INTEGER, step INTEGER, value REAL,"
        " PRIMARY KEY (run, rank, layer, metric, step)) WITHOUT ROWID"
    )
    return write_batches(
        path,
        conn,
        steps,
        "INSERT INTO p VALUES (?, ?, ?, ?, ?, ?)",
        lambda batch_steps: [
            (1, 0, layer, m, s, float(values[s % 16, m, layer]))
            for s in batch_steps
            for m in range(METRICS)
            for layer in range(LAYERS)
        ],
    )


def blobs(path: Path, values: np.ndarray, steps: int) -> tuple[float, float]:
    conn = connect(path, 65536)
    conn.execute(
        "CREATE TABLE p (id INTEGER PRIMARY KEY, run INTEGER, rank INTEGER, step INTEGER, metric INTEGER, vals BLOB)"
    )
    conn.execute("CREATE UNIQUE INDEX k ON p (run, rank, step, metric)")
    return write_batches(
        path,
        conn,
        steps,
        "INSERT INTO p (run, rank, step, metric, vals) VALUES (?, ?, ?, ?, ?)",
        lambda batch_steps: [
            (1, 0, s, m, values[s % 16, m].astype("<f4").tobytes()) for s in batch_steps for m in range(METRICS)
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args()
    values = np.random.default_rng(0).random((16, METRICS, LAYERS), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        n_rate, n_size = narrow(Path(tmp) / "narrow.db", values, args.steps)
        b_rate, b_size = blobs(Path(tmp) / "blobs.db", values, args.steps)
    print(f"narrow rows (one per point, WITHOUT ROWID): {n_rate:12,.0f} points/s  {n_size:6.2f} bytes/point")
    print(f"float32 blob per (step, metric):            {b_rate:12,.0f} points/s  {b_size:6.2f} bytes/point")
    print(f"blob / narrow: {b_rate / n_rate:.0f}× faster, {n_size / b_size:.1f}× smaller")


if __name__ == "__main__":
    main()
