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


def narrow(path: Path, values: np.ndarray, steps: int) -> tuple[float, float]:
    conn = connect(path, 4096)
    conn.execute(
        "CREATE TABLE p (run INTEGER, rank INTEGER, layer INTEGER, metric INTEGER, step INTEGER, value REAL,"
        " PRIMARY KEY (run, rank, layer, metric, step)) WITHOUT ROWID"
    )
    t0 = time.perf_counter()
    for s0 in range(0, steps, BATCH_STEPS):
        rows = [
            (1, 0, layer, m, s, float(values[s % 16, m, layer]))
            for s in range(s0, s0 + BATCH_STEPS)
            for m in range(METRICS)
            for layer in range(LAYERS)
        ]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO p VALUES (?, ?, ?, ?, ?, ?)", rows)
        conn.execute("COMMIT")
    rate = steps * LAYERS * METRICS / (time.perf_counter() - t0)
    return rate, size(path, conn) / (steps * LAYERS * METRICS)


def blobs(path: Path, values: np.ndarray, steps: int) -> tuple[float, float]:
    conn = connect(path, 65536)
    conn.execute(
        "CREATE TABLE p (id INTEGER PRIMARY KEY, run INTEGER, rank INTEGER, step INTEGER, metric INTEGER, vals BLOB)"
    )
    conn.execute("CREATE UNIQUE INDEX k ON p (run, rank, step, metric)")
    t0 = time.perf_counter()
    for s0 in range(0, steps, BATCH_STEPS):
        rows = [
            (1, 0, s, m, values[s % 16, m].astype("<f4").tobytes())
            for s in range(s0, s0 + BATCH_STEPS)
            for m in range(METRICS)
        ]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO p (run, rank, step, metric, vals) VALUES (?, ?, ?, ?, ?)", rows)
        conn.execute("COMMIT")
    rate = steps * LAYERS * METRICS / (time.perf_counter() - t0)
    return rate, size(path, conn) / (steps * LAYERS * METRICS)


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
