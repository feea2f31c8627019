"""The catalogue of metrics and scalars: every name the agent measures, the collector stores, rules watch, Prometheus
exports and the web view colours, with what it means.

One :class:`Measure` per name; the agent's metric list, rule validation, the ``/metrics`` family names, the Grafana
panels and ``GET /api/v1/catalog`` are all read from :data:`CATALOG`, so a new metric is added here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "AGENT_METRICS",
    "CATALOG",
    "LAYER_METRICS",
    "LOWER_IS_WORSE",
    "OVERVIEW_METRICS",
    "SCALARS",
    "Measure",
    "Polarity",
    "catalog_document",
    "layer_metric",
    "lower_is_worse",
]

Polarity = Literal["higher_is_worse", "lower_is_worse"]
Scope = Literal["layer", "run"]
Source = Literal["agent", "collector"]


@dataclass(frozen=True)
class Measure:
    """One catalogued figure.

    ``scope`` is ``layer`` for a per-layer metric, ``run`` for a per-run scalar; ``polarity`` says which direction is
    the bad one (the "worst layers" of a cosine are its lowest); ``unit`` is ``ratio`` for values stored as ratios
    (5% is 0.05), else the unit's name; ``family`` is the exported Prometheus gauge family.
    """

    name: str
    scope: Scope
    polarity: Polarity
    unit: str
    family: str
    meaning: str
    formula: str = ""
    source: Source = "agent"

    @property
    def is_ratio(self) -> bool:
        """Whether the value is a ratio (a threshold above 1 is then almost certainly a percentage by mistake)."""
        return self.unit == "ratio"


def _layer(
    name: str,
    polarity: Polarity,
    unit: str,
    meaning: str,
    formula: str = "",
    family: str = "",
    source: Source = "agent",
) -> Measure:
    # Ratios end in ``_ratio``; ``nonfinite_count`` becomes ``_values`` because ``_count`` is reserved for histograms
    # and summaries in the exposition format.
    if not family:
        family = f"quantwatch_layer_{name}_ratio" if name.endswith("_rel_l2") else f"quantwatch_layer_{name}"
    return Measure(name, "layer", polarity, unit, family, meaning, formula, source)


def _scalar(name: str, polarity: Polarity, unit: str, meaning: str) -> Measure:
    return Measure(name, "run", polarity, unit, f"quantwatch_run_{name}", meaning)


_REL_L2 = "‖Q(t) − t‖₂ / ‖t‖₂"
_LAYER_MEASURES = (
    _layer("weight_rel_l2", "higher_is_worse", "ratio", "quantization error of the layer's weight", _REL_L2),
    _layer("act_rel_l2", "higher_is_worse", "ratio", "quantization error of the layer's input activation", _REL_L2),
    _layer("grad_rel_l2", "higher_is_worse", "ratio", "quantization error of the layer's output gradient", _REL_L2),
    _layer(
        "output_rel_l2",
        "higher_is_worse",
        "ratio",
        "deviation of the quantized layer's output from its FP32 shadow on the same input",
        "‖y_q − y_ref‖₂ / ‖y_ref‖₂",
    ),
    _layer(
        "output_cosine",
        "lower_is_worse",
        "cosine",
        "cosine between the quantized layer's output and its FP32 shadow's",
        "⟨y_q, y_ref⟩ / (‖y_q‖₂‖y_ref‖₂)",
    ),
    _layer(
        "output_sqnr_db",
        "lower_is_worse",
        "dB",
        "signal-to-quantization-noise ratio of the layer's output against its FP32 shadow",
        "20·log10(‖y_ref‖₂ / ‖y_ref − y_q‖₂)",
    ),
    _layer(
        "update_cosine",
        "lower_is_worse",
        "cosine",
        "cosine between the weight gradient on the quantized path and the FP32 reference gradient (update direction)",
        "⟨g_q, g_ref⟩ / (‖g_q‖₂‖g_ref‖₂)",
    ),
    _layer(
        "update_rel_l2",
        "higher_is_worse",
        "ratio",
        "relative error of the weight gradient on the quantized path against the FP32 reference gradient (update "
        "noise; quantized training stops being effective once it exceeds about 1/√3, arXiv 2505.19115)",
        "‖g_q − g_ref‖₂ / ‖g_ref‖₂",
    ),
    _layer(
        "underflow_ratio",
        "higher_is_worse",
        "ratio",
        "share of non-zero inputs that quantize to zero",
        "#{t ≠ 0, Q(t) = 0} / #{t ≠ 0}",
    ),
    _layer(
        "overflow_ratio",
        "higher_is_worse",
        "ratio",
        "share of values clipped at the format's maximum",
        "#{|t|/s > max} / #t",
    ),
    _layer(
        "nonfinite_count",
        "higher_is_worse",
        "values",
        "number of NaN or infinite values seen in the layer's tensors",
        family="quantwatch_layer_nonfinite_values",
    ),
    _layer("amax", "higher_is_worse", "absolute", "largest magnitude of the quantized tensor", "max |t|"),
    _layer("scale", "higher_is_worse", "absolute", "the scale the quantizer used (per-tensor; NaN when blockwise)"),
    _layer(
        "weight_drift_rel_l2",
        "higher_is_worse",
        "ratio",
        "distance of the quantized model's master weights from a full FP32 shadow model trained in lockstep",
        "‖W_q − W_shadow‖₂ / ‖W_shadow‖₂",
    ),
    _layer(
        "rank_weight_mismatch",
        "higher_is_worse",
        "ratio",
        "relative spread of the layer's master weights across the data-parallel replicas that should hold the same "
        "values, for this rank against its replica group's reference (0 when bit-identical); computed by the "
        "collector from every rank's weight fingerprint",
        "0 when bits and sums agree, else max(|√Σw_r² − √Σw_ref²| / √Σw_ref², |Σw_r − Σw_ref| / max(|Σw_ref|, "
        "√Σw_ref²), 2⁻²³): a lower bound of ‖W_r − W_ref‖₂ / ‖W_ref‖₂",
        family="quantwatch_layer_rank_weight_mismatch_ratio",
        source="collector",
    ),
)

_SCALAR_MEASURES = (
    _scalar("loss", "higher_is_worse", "loss", "training loss of the quantized model"),
    _scalar("loss_shadow", "higher_is_worse", "loss", "training loss of the FP32 shadow model, when one runs"),
    _scalar("tokens_per_second", "lower_is_worse", "tokens/s", "training throughput"),
    _scalar("step_seconds", "higher_is_worse", "seconds", "wall time of one training step"),
    _scalar("device_memory_bytes", "higher_is_worse", "bytes", "device memory in use"),
    _scalar("agent_overhead_ratio", "higher_is_worse", "ratio", "share of the step's time the agent took"),
)

CATALOG: Mapping[str, Measure] = {m.name: m for m in (*_LAYER_MEASURES, *_SCALAR_MEASURES)}
"""Every catalogued figure by name."""

LAYER_METRICS: tuple[str, ...] = tuple(m.name for m in _LAYER_MEASURES)
"""Canonical per-layer metrics, in the order the agent sends them."""

AGENT_METRICS: tuple[str, ...] = tuple(m.name for m in _LAYER_MEASURES if m.source == "agent")
"""The per-layer metrics the agent measures (the rest the collector computes from what ranks sent)."""

SCALARS: tuple[str, ...] = tuple(m.name for m in _SCALAR_MEASURES)
"""Canonical per-run scalars."""

OVERVIEW_METRICS: tuple[str, ...] = (
    "output_rel_l2",
    "output_cosine",
    "output_sqnr_db",
    "weight_rel_l2",
    "act_rel_l2",
    "grad_rel_l2",
    "underflow_ratio",
    "overflow_ratio",
)
"""The per-layer metrics an overview of a run shows, output deviation first: the Grafana dashboards' metric choices,
and what the benchmarks' synthetic runs send."""

LOWER_IS_WORSE: frozenset[str] = frozenset(m.name for m in CATALOG.values() if m.polarity == "lower_is_worse")
"""Names whose smaller values are the worse ones (cosines, SQNR, throughput)."""


def layer_metric(name: str) -> Measure | None:
    """The catalogued per-layer metric ``name``, or None."""
    measure = CATALOG.get(name)
    return measure if measure is not None and measure.scope == "layer" else None


def lower_is_worse(name: str) -> bool:
    """Whether a smaller value of ``name`` is the worse one; uncatalogued names count higher as worse."""
    return name in LOWER_IS_WORSE


def catalog_document() -> dict[str, Any]:
    """The catalogue as the JSON document ``GET /api/v1/catalog`` serves."""
    return {
        "metrics": [asdict(m) | {"is_ratio": m.is_ratio} for m in _LAYER_MEASURES],
        "scalars": [asdict(m) | {"is_ratio": m.is_ratio} for m in _SCALAR_MEASURES],
    }
