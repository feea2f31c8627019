"""Alert evaluation alone: ``AlertEngine.evaluate`` inside a write transaction on a fresh SQLite file.

512 layers × 16 steps per batch, one rule (``output_rel_l2 > 0.05`` for 3 steps), random values around it, so series
move between inactive, pending and firing. Prints the median and quartiles of the time per batch after a warm-up.
Compare two trees side by side by running it alternately with ``PYTHONPATH=<tree>``:
``PYTHONPATH=/tmp/base .venv/bin/python bench/alert_eval.py; PYTHONPATH=$PWD .venv/bin/python bench/alert_eval.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from quantwatch.service import Settings
from quantwatch.service.alerts.catalog import put_rule
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.evaluator import StepInput
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.core.db import make_engine, make_sessionmaker, upgrade, write_session

LAYERS = [f"blocks.{i // 4}.{['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2'][i % 4]}" for i in range(512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(Settings(database_url=f"sqlite:///{tmp}/alerts.db"))
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        alerts = AlertEngine(external_url="http://127.0.0.1:9", delivery_horizon_seconds=60)
        rule = Rule(name="drift", metric="output_rel_l2", op=">", threshold=0.05, consecutive=3)
        with write_session(sessions) as session:
            put_rule(session, alerts, rule, create=True)
        times = []
        for batch in range(args.batches):
            steps = [
                StepInput(step, float(step), {"output_rel_l2": (0.01 + 0.08 * rng.random(len(LAYERS))).tolist()}, {})
                for step in range(batch * 16, batch * 16 + 16)
            ]
            started = time.perf_counter()
            with write_session(sessions) as session:
                alerts.evaluate(session, "bench", 0, LAYERS, steps)
            times.append(time.perf_counter() - started)
        engine.dispose()
    kept = sorted(times[args.warmup :])
    quarter = len(kept) // 4
    print(
        f"{len(LAYERS)} layers x 16 steps, 1 rule: median {1000 * statistics.median(kept):.1f} ms/batch "
        f"(quartiles {1000 * kept[quarter]:.1f}, {1000 * kept[-quarter - 1]:.1f}), {len(kept)} batches"
    )


if __name__ == "__main__":
    main()
