"""The exporter thread's derivation of a step's metrics (numpy) against `ErrorStats`'s own figures (torch), value for
value, degenerate and non-finite sums included; and the resident memory a sampled step reports."""

from __future__ import annotations

import os

import numpy as np
import torch

from quantwatch.agent.layers import KIND_NAMES
from quantwatch.agent.readout import METRIC_KINDS, NF, derive
from quantwatch.agent.scalars import resident_memory_bytes
from quantwatch.kernels import ErrorStats

_NK = len(KIND_NAMES)
_FIGURES = {
    "weight_rel_l2": "rel_l2",
    "act_rel_l2": "rel_l2",
    "grad_rel_l2": "rel_l2",
    "output_rel_l2": "rel_l2",
    "output_cosine": "cosine",
    "output_sqnr_db": "sqnr_db",
    "update_cosine": "cosine",
    "update_rel_l2": "rel_l2",
    "underflow_ratio": "underflow_ratio",
    "overflow_ratio": "overflow_ratio",
    "amax": "amax",
    "weight_drift_rel_l2": "rel_l2",
}


def _block(rng: np.random.Generator, layers: int) -> np.ndarray:
    """Random partial sums (and a scale per layer) with zeros, NaN, ±inf and extreme magnitudes mixed in."""
    block = rng.random((layers, _NK * NF + 1)) * 10.0 ** rng.integers(-6, 6, size=(layers, 1))
    specials = np.array([0.0, np.nan, np.inf, -np.inf, 1e-300, 1e300, -1.0])
    mask = np.less(rng.random(block.shape), 0.25)
    block[mask] = rng.choice(specials, size=int(mask.sum()))
    return block


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (np.isnan(a) and np.isnan(b)) or (a == b and np.signbit(a) == np.signbit(b))


def test_derive_gives_error_stats_figures_exactly() -> None:
    rng = np.random.default_rng(7)
    names = list(METRIC_KINDS)
    compared = 0
    for _ in range(200):
        layers = int(rng.integers(1, 12))
        block = _block(rng, layers)
        present = (rng.random((layers, _NK + 1)) < 0.8).tolist()
        out = derive(block, present, names)
        for layer in range(layers):
            for metric, figure in _FIGURES.items():
                (kind,) = METRIC_KINDS[metric]
                row = torch.from_numpy(block[layer, kind * NF : (kind + 1) * NF].copy())
                filled = present[layer][kind] and not np.isnan(block[layer, kind * NF])
                expected = float(getattr(ErrorStats.from_tensor(row), figure)) if filled else None
                got = out[metric][layer] if metric in out else None
                assert _same(got, expected), (metric, layer, got, expected)
                compared += expected is not None
            expected_scale = float(block[layer, _NK * NF]) if present[layer][_NK] else None
            assert _same(out["scale"][layer] if "scale" in out else None, expected_scale)
    assert compared > 1000


def test_derive_leaves_out_metrics_no_layer_has() -> None:
    block = np.ones((2, _NK * NF + 1))
    present = [[False] * (_NK + 1), [False] * (_NK + 1)]
    assert derive(block, present, list(METRIC_KINDS)) == {}


def test_resident_memory_is_the_calling_process_s_after_a_fork() -> None:
    parent = resident_memory_bytes()
    assert parent is not None
    assert parent > 0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child grows by 256 MiB it touches and reports what it reads before and after
        os.close(read)
        before = resident_memory_bytes() or 0.0
        grown = np.ones(32 * 2**20)
        after = resident_memory_bytes() or 0.0
        os.write(write, f"{before} {after} {grown.size}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        before, after, _ = (float(v) for v in fh.read().split())
    os.waitpid(pid, 0)
    assert after - before >= 200 * 2**20
    assert (resident_memory_bytes() or 0.0) < parent + 100 * 2**20
