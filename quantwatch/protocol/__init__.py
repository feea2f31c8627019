"""The shared vocabulary below the agent and the collector: the metric catalogue, format names, the wire contract
and the retry policy (ARCHITECTURE.md). It imports neither torch nor FastAPI, so both sides, the dashboards' build
script, the demo and the CLI can read it."""

from quantwatch.protocol import wire
from quantwatch.protocol.catalog import (
    AGENT_METRICS,
    CATALOG,
    LAYER_METRICS,
    LOWER_IS_WORSE,
    OVERVIEW_METRICS,
    SCALARS,
    Measure,
    catalog_document,
    layer_metric,
    lower_is_worse,
)
from quantwatch.protocol.formats import (
    ELEMENT_FORMATS,
    HIGH_PRECISION,
    MAX_CANDIDATE_LENGTH,
    OWN_BLOCK,
    PRESETS,
    SCALING_KINDS,
    STOCHASTIC_SUFFIX,
    TENSOR_KINDS,
    WHATIF_CANDIDATES,
    candidate_bits,
    candidate_spec,
    check_candidate,
    check_layer_format,
    format_bits,
    own_candidates,
)
from quantwatch.protocol.retry import TRANSIENT_4XX, Backoff, is_transient_status, parse_retry_after
from quantwatch.protocol.wire import *  # noqa: F403 (the whole wire contract, listed once: wire.__all__)

__all__ = [
    "AGENT_METRICS",
    "CATALOG",
    "ELEMENT_FORMATS",
    "HIGH_PRECISION",
    "LAYER_METRICS",
    "LOWER_IS_WORSE",
    "MAX_CANDIDATE_LENGTH",
    "OVERVIEW_METRICS",
    "OWN_BLOCK",
    "PRESETS",
    "SCALARS",
    "SCALING_KINDS",
    "STOCHASTIC_SUFFIX",
    "TENSOR_KINDS",
    "TRANSIENT_4XX",
    "WHATIF_CANDIDATES",
    "Backoff",
    "Measure",
    "candidate_bits",
    "candidate_spec",
    "catalog_document",
    "check_candidate",
    "check_layer_format",
    "format_bits",
    "is_transient_status",
    "layer_metric",
    "lower_is_worse",
    "own_candidates",
    "parse_retry_after",
]
__all__ += wire.__all__
