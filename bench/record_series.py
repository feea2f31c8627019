"""Records the per-layer series that bench/storage_layout.py replays (issue 21), into bench/data/series.npz.

Two sources of real training figures: ``quantwatch demo`` (its small FP8/FP4 transformer, 9 layers, read back
from the demo's SQLite store) and bench/agent_overhead.py's model (4 blocks of width 256, FP8 attention and NVFP4
MLP, 16 layers) trained on CPU with the agent at ``every=1`` and every default metric, its wire batches kept in
memory (fewer steps by default: every=1 with every metric is slow on a CPU). Each metric's (steps × layers) float32
matrix is saved as ``<source>/<metric>``, missing as NaN.

    .venv/bin/python bench/record_series.py [--demo-steps 400] [--agent-steps 200]   # ~10 minutes on two cores
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "data" / "series.npz"


def demo_series(steps: int) -> dict[str, np.ndarray]:
    """Every metric of the demo's run, from its store (rank 0, step order)."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "demo.db"
        cmd = [sys.executable, "-m", "quantwatch.cli", "demo", "--steps", str(steps), "--port", "0"]
        subprocess.run([*cmd, "--database", str(db)], check=True, capture_output=True, timeout=1800)
        conn = sqlite3.connect(db)
        n_layers = conn.execute("SELECT layer_count FROM runs WHERE name = 'demo'").fetchone()[0]
        out = {}
        for nid, name in conn.execute("SELECT id, name FROM metric_names ORDER BY name").fetchall():
            rows = conn.execute(
                "SELECT vals FROM points WHERE name_id = ? AND rank = 0 ORDER BY step", (nid,)
            ).fetchall()
            if rows:
                matrix = np.full((len(rows), n_layers), np.nan, dtype=np.float32)
                for i, (blob,) in enumerate(rows):
                    row = np.frombuffer(blob, dtype="<f4")
                    matrix[i, : row.size] = row
                out[f"demo/{name}"] = matrix
        conn.close()
    return out


def agent_series(steps: int) -> dict[str, np.ndarray]:
    """Every default metric of bench/agent_overhead.py's model trained ``steps`` steps with the agent at every=1."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from agent_overhead import VOCAB, make_model
    from torch.nn import functional

    import quantwatch.agent as qw

    model = make_model()
    exporter = qw.InMemoryExporter()
    monitor = qw.attach(model, run="record", exporter=exporter, every=1, whatif_every=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (8, 65), generator=gen)
        loss = functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.step(loss=loss)
    monitor.close()
    records = sorted((s for b in exporter.batches for s in b.steps), key=lambda s: s.step)
    names = sorted({m for s in records for m in s.metrics})
    return {
        f"agent/{name}": np.array(
            [[np.nan if v is None else v for v in s.metrics[name]] for s in records if name in s.metrics],
            dtype=np.float32,
        )
        for name in names
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo-steps", type=int, default=400)
    parser.add_argument("--agent-steps", type=int, default=200)
    args = parser.parse_args()
    series = {**demo_series(args.demo_steps), **agent_series(args.agent_steps)}
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, **series)
    for name, matrix in series.items():
        print(f"{name:32s} {matrix.shape}")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
