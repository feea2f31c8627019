"""Records the ingest payloads of fixed shapes as the agent encodes them (run from the repository root).

The files beside this script were written by the agent of commit 2debfd3 (protocol before versioning); the collector
must keep accepting them as the wire grows (tests/service/test_recorded_payloads.py). Run it again only to record a
new generation into a new folder, never to overwrite an old one: ``python tests/service/data/payloads/record.py DIR``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

import quantwatch.agent as qw
from quantwatch.agent.wire import Batch, StepRecord, encode_batch
from quantwatch.kernels import QuantLinear, QuantSpec


def _trained_batches() -> list[Batch]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        QuantLinear(16, 32),
        torch.nn.ReLU(),
        QuantLinear(32, 8, weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4")),
    )
    sink = qw.InMemoryExporter()
    monitor = qw.attach(model, run="recorded/agent-v0", exporter=sink, every=1, rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(4, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(step, loss=loss.item())
    monitor.close()
    return list(sink.batches)


def _edge_batch() -> Batch:
    return Batch(
        run="recorded:edge.case-1",
        rank=3,
        batch_id="edge-0001",
        layers=("a.b", "c"),
        steps=(
            StepRecord(10, 1764467200.25, {"output_rel_l2": [0.031, None], "amax": [math.inf, math.nan]}, {}),
            StepRecord(11, 1764467201.5, {}, {"loss": 2.71, "custom_scalar": -1.0}),
        ),
    )


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    manifest = []
    batches = [*_trained_batches(), _edge_batch()]
    for index, batch in enumerate(batches):
        for encoding in ("json", "msgpack"):
            for compress in (False, True):
                encoded = encode_batch(batch, encoding, compress)
                name = f"batch{index}.{encoding}{'.gz' if compress else ''}"
                (out / name).write_bytes(encoded.body)
                manifest.append(
                    {
                        "file": name,
                        "content_type": encoded.content_type,
                        "gzip": compress,
                        "run": batch.run,
                        "rank": batch.rank,
                        "layers": list(batch.layers),
                        "steps": [s.step for s in batch.steps],
                        "points": encoded.points,
                    }
                )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
