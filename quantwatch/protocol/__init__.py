"""The shared vocabulary below the agent and the collector: the metric catalogue, format names, the wire contract
and the retry policy (ARCHITECTURE.md). It imports neither torch nor FastAPI, so both sides, the dashboards' build
script, the demo and the CLI can read it."""

from quantwatch.protocol.catalog import (
    CATALOG,
    LAYER_METRICS,
    LOWER_IS_WORSE,
    SCALARS,
    Measure,
    catalog_document,
    layer_metric,
    lower_is_worse,
)
from quantwatch.protocol.formats import (
    ELEMENT_FORMATS,
    HIGH_PRECISION,
    PRESETS,
    SCALING_KINDS,
    TENSOR_KINDS,
    check_layer_format,
    format_bits,
)
from quantwatch.protocol.retry import TRANSIENT_4XX, Backoff, is_transient_status, parse_retry_after
from quantwatch.protocol.wire import (
    CONTENT_TYPES,
    INGEST_PATH,
    LAYER_FORMATS_FIELD,
    MAX_BATCH_ID_LENGTH,
    MAX_LAYER_NAME_LENGTH,
    MAX_RANK,
    MAX_STEP,
    NONFINITE_TOKENS,
    PROTOCOL_VERSION,
    RUN_NAME_PATTERN,
    RUN_NAME_RULE,
    SERIES_NAME_PATTERN,
    ingest_json_schema,
)

__all__ = [
    "CATALOG",
    "CONTENT_TYPES",
    "ELEMENT_FORMATS",
    "HIGH_PRECISION",
    "INGEST_PATH",
    "LAYER_FORMATS_FIELD",
    "LAYER_METRICS",
    "LOWER_IS_WORSE",
    "MAX_BATCH_ID_LENGTH",
    "MAX_LAYER_NAME_LENGTH",
    "MAX_RANK",
    "MAX_STEP",
    "NONFINITE_TOKENS",
    "PRESETS",
    "PROTOCOL_VERSION",
    "RUN_NAME_PATTERN",
    "RUN_NAME_RULE",
    "SCALARS",
    "SCALING_KINDS",
    "SERIES_NAME_PATTERN",
    "TENSOR_KINDS",
    "TRANSIENT_4XX",
    "Backoff",
    "Measure",
    "catalog_document",
    "check_layer_format",
    "format_bits",
    "ingest_json_schema",
    "is_transient_status",
    "layer_metric",
    "lower_is_worse",
    "parse_retry_after",
]
