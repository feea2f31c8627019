"""From the statistics a sampled step collected to the figures of its record: which measurement kinds each metric
needs, the packed layout the monitor reduces a step into (one tensor), its non-blocking copy to the host and the
vectorised derivation of every layer's metrics from the partial sums (run on the exporter thread)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from quantwatch.agent.layers import (
    KIND_DRIFT,
    KIND_GRAD,
    KIND_INPUT,
    KIND_NAMES,
    KIND_OUTPUT,
    KIND_UPDATE,
    KIND_WEIGHT,
)
from quantwatch.kernels import ErrorStats
from quantwatch.kernels.partial_sums import (
    NUMPY_FIGURES,
    cosine_of,
    overflow_ratio_of,
    rel_l2_of,
    sqnr_db_of,
    underflow_ratio_of,
)

__all__ = ["ESTIMATED_METRICS", "METRIC_KINDS", "NF", "ROW", "SUMS", "DeviceReader", "derive", "metric_kinds"]

# Per metric: the partial-sum figure it reads and the measurement kinds a sampled step needs for it. A metric of one
# kind reads that kind's figure; ``nonfinite_count`` sums over its kinds and ``scale`` is the quantizer's own.
_SOURCES: dict[str, tuple[str, frozenset[int]]] = {
    "weight_rel_l2": ("rel_l2", frozenset({KIND_WEIGHT})),
    "act_rel_l2": ("rel_l2", frozenset({KIND_INPUT})),
    "grad_rel_l2": ("rel_l2", frozenset({KIND_GRAD})),
    "output_rel_l2": ("rel_l2", frozenset({KIND_OUTPUT})),
    "output_cosine": ("cosine", frozenset({KIND_OUTPUT})),
    "output_sqnr_db": ("sqnr_db", frozenset({KIND_OUTPUT})),
    "update_cosine": ("cosine", frozenset({KIND_UPDATE})),
    "update_rel_l2": ("rel_l2", frozenset({KIND_UPDATE})),
    "underflow_ratio": ("underflow_ratio", frozenset({KIND_INPUT})),
    "overflow_ratio": ("overflow_ratio", frozenset({KIND_INPUT})),
    "nonfinite_count": ("nonfinite_count", frozenset({KIND_WEIGHT, KIND_INPUT, KIND_GRAD})),
    "amax": ("amax", frozenset({KIND_INPUT})),
    "scale": ("scale", frozenset({KIND_INPUT})),
    "weight_drift_rel_l2": ("rel_l2", frozenset({KIND_DRIFT})),
}
# Which measurements each metric needs on a sampled step.
METRIC_KINDS: dict[str, frozenset[int]] = {metric: kinds for metric, (_, kinds) in _SOURCES.items()}
# The metrics a kind's estimate (``shadow_rows``) makes estimated.
ESTIMATED_METRICS: dict[int, tuple[str, ...]] = {
    KIND_OUTPUT: ("output_rel_l2", "output_cosine", "output_sqnr_db"),
    KIND_UPDATE: ("update_cosine", "update_rel_l2"),
}


def metric_kinds(metrics: frozenset[str]) -> frozenset[int]:
    """The measurement kinds that measuring ``metrics`` needs."""
    kinds: set[int] = set()
    for metric in metrics:
        kinds |= METRIC_KINDS[metric]
    return frozenset(kinds)


_FIELDS = ErrorStats.FIELDS
NF = len(_FIELDS)
_NK = len(KIND_NAMES)
SUMS = _NK * NF  # per layer: every kind's partial sums (the scales follow those of every layer)
ROW = SUMS + 1  # per layer, as `derive` takes them: the sums, then the scale


class DeviceReader:
    """Gets a packed statistics tensor to the host without blocking the training thread.

    On CUDA the copy goes to pinned memory with ``non_blocking=True`` and an event marks its end; the exporter thread
    waits on the event.  On CPU the tensor already is on the host."""

    def __init__(self, packed: Tensor) -> None:
        self._event: Any = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
            self._host = host
        else:
            self._host = packed.to("cpu")

    def read(self) -> np.ndarray:
        """The values as a float64 numpy array (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        values: np.ndarray = self._host.numpy()
        return values


def _derived(field: str, s: dict[str, np.ndarray]) -> np.ndarray:
    """One of `ErrorStats`'s derived figures from its sums, by its own formulas on NumPy arrays (the same bits)."""
    if field == "rel_l2":
        return np.asarray(rel_l2_of(s["sum_x2"], s["sum_err2"], NUMPY_FIGURES))
    if field == "cosine":
        return np.asarray(cosine_of(s["sum_qx"], s["sum_q2"], s["sum_x2"], NUMPY_FIGURES))
    if field == "sqnr_db":
        return np.asarray(sqnr_db_of(s["sum_x2"], s["sum_err2"], NUMPY_FIGURES))
    if field == "underflow_ratio":
        return np.asarray(underflow_ratio_of(s["underflow_count"], s["nonzero_count"], NUMPY_FIGURES))
    if field == "overflow_ratio":
        return np.asarray(overflow_ratio_of(s["overflow_count"], s["numel"], s["nonfinite_count"], NUMPY_FIGURES))
    return s[field]


def derive(block: np.ndarray, present: list[list[bool]], metric_names: list[str]) -> dict[str, list[float | None]]:
    """Per-layer metric values from the packed partial sums (vectorised over layers and kinds; only the figures
    ``metric_names`` read)."""
    n = block.shape[0]
    sums = block[:, : _NK * NF].reshape(n, _NK, NF)
    fields = {name: sums[..., i] for i, name in enumerate(_FIELDS)}
    mask = np.array(present, dtype=bool).reshape(n, _NK + 1)
    # A NaN count of elements marks statistics that were never filled (a tensor changed before they were computed).
    mask[:, :_NK] &= ~np.isnan(block[:, : _NK * NF : NF])
    # Comparisons of non-finite tensors have NaN sums, which the ratio formulas report as NaN (a signal).
    derived: dict[str, np.ndarray] = {}
    out: dict[str, list[float | None]] = {}
    have: np.ndarray
    with np.errstate(all="ignore"):
        for metric in metric_names:
            if metric == "scale":
                values = block[:, _NK * NF]
                have = mask[:, _NK]
            else:
                field, kinds_of = _SOURCES[metric]
                if field not in derived:
                    derived[field] = _derived(field, fields)
                if metric == "nonfinite_count":
                    kinds = sorted(kinds_of)
                    have = np.asarray(mask[:, kinds].any(axis=1))
                    values = np.where(mask[:, kinds], derived[field][:, kinds], 0.0).sum(axis=1)
                else:
                    (kind,) = kinds_of
                    values = derived[field][:, kind]
                    have = mask[:, kind]
            if have.any():
                out[metric] = [float(v) if h else None for v, h in zip(values.tolist(), have.tolist(), strict=True)]
    return out
