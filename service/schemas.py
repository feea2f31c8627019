"""Pydantic models of the REST API's answers (they define the OpenAPI schema)."""

from __future__ import annotations

from pydantic import BaseModel, Field

# JSON cannot carry NaN or infinities: like the wire format, answers use the strings "nan", "inf" and "-inf".
Value = float | str | None


class FiringEpisode(BaseModel):
    """An alert episode firing on the run (protocol ``FIRING_EPISODE_KEYS``)."""

    episode: int = Field(description="The episode's id (GET /api/v1/alerts/{episode}).")
    rule: str
    layer: str = Field(description='The layer ("" for a run-level rule).')
    ranks: list[int]
    since_step: int | None = Field(description="The step it started firing at.")
    severity: str


class IngestAnswer(BaseModel):
    """Answer to an accepted (or duplicate) batch."""

    batch_id: str
    duplicate: bool = Field(description="True when this batch_id was stored before; nothing was stored again.")
    points: int = Field(description="Values stored by this request (0 for a duplicate).")
    firing_episodes: list[FiringEpisode] | None = Field(
        None, description="The run's firing alert episodes once this batch is stored; absent when none fires."
    )


class RunActionInfo(BaseModel):
    """An action the agent took on the training job (``quantwatch.agent.actions``)."""

    step: int = Field(description="The step it was taken after (in effect from the next step on).")
    rank: int
    action: str = Field(description="keep_high_precision, save_shadow_checkpoint or stop_training.")
    layer: str = Field(description='The layer it changed ("" for the whole run).')
    detail: str = Field(description="What changed, in words.")
    episode: int | None = Field(description="The alert episode that asked for it, if any.")
    recorded_at: float = Field(description="Seconds since the epoch when the collector stored it.")


class RunSummary(BaseModel):
    """One run: progress over all ranks, what it sends, and its firing alerts."""

    name: str
    created_at: float = Field(description="Seconds since the epoch when the collector first saw the run.")
    first_step: int | None
    last_step: int | None
    last_seen_at: float | None = Field(description="Seconds since the epoch of the latest accepted batch.")
    layer_count: int
    ranks: list[int]
    points: int = Field(description="Values accepted so far (re-sent values count again).")
    metrics: list[str] = Field(description="Per-layer metric names seen.")
    scalars: list[str] = Field(description="Scalar names seen.")
    firing_alerts: int = Field(description="Alerts of this run currently firing.")


class FormatChangeInfo(BaseModel):
    """From ``step`` on, the layer quantizes its ``kind`` tensor (weight, input or grad) to ``format``."""

    step: int
    kind: str
    format: str


class LayerFormats(BaseModel):
    """A layer's current number format per tensor kind, as the agent declares it (null: never declared)."""

    weight: str | None
    input: str | None
    grad: str | None


class LayerInfo(BaseModel):
    """A layer of a run; ``index`` is its position in model order (first-seen order)."""

    index: int
    name: str
    formats: LayerFormats | None = Field(description="Current formats; null when the agent never declared any.")
    format_changes: list[FormatChangeInfo] = Field(
        description="When a format changed mid-run: every recorded format with its step, in step order; else empty."
    )


class Series(BaseModel):
    """A series over aligned step buckets of ``bucket_steps`` steps (1 = exact values, min = mean = max)."""

    steps: list[int] = Field(description="First step of each non-empty bucket (clipped to the requested start).")
    min: list[Value]
    mean: list[Value]
    max: list[Value]
    bucket_steps: int
    estimated: list[int] = Field(
        description="The `steps` of the buckets holding a value the agent estimated from a subset of rows "
        "(`shadow_rows`) rather than computed exactly; empty when all are exact."
    )
    raw_from_step: int | None = Field(
        default=None,
        description="Present only when the range reaches steps whose raw points retention dropped: the first step "
        "still held raw. Buckets before it come from the rollups, so `bucket_steps` is at least 64 (README Retention).",
    )


class Heatmap(BaseModel):
    """Layers (model order) × step buckets; ``values[i][j]`` is layer i in bucket j (null: nothing measured)."""

    layers: list[str]
    steps: list[int]
    values: list[list[Value]]
    bucket_steps: int
    raw_from_step: int | None = Field(
        default=None, description="As in a series: present only when the range reaches steps retention dropped."
    )


class StepRanks(BaseModel):
    """One metric at one step, layers (model order) × the run's ranks; ``values[i][j]`` is layer i on ``ranks[j]``
    (null: that rank did not measure it at this step)."""

    step: int | None = Field(
        description="The first step at or after the requested one at which some rank measured the metric "
        "(null when none did)."
    )
    metric: str
    layers: list[str]
    ranks: list[int]
    values: list[list[Value]]


class Health(BaseModel):
    """Liveness or readiness."""

    status: str


class CatalogEntry(BaseModel):
    """One catalogued metric or scalar (the protocol's catalogue)."""

    name: str
    scope: str = Field(description="``layer`` for a per-layer metric, ``run`` for a per-run scalar.")
    polarity: str = Field(description="``higher_is_worse`` or ``lower_is_worse``: which direction is the bad one.")
    unit: str = Field(description="``ratio`` for values stored as ratios (5% is 0.05), else the unit's name.")
    is_ratio: bool
    family: str = Field(description="The Prometheus gauge family ``/metrics`` exports it as.")
    meaning: str
    formula: str


class Catalog(BaseModel):
    """Every figure the agent measures and the collector knows by name."""

    metrics: list[CatalogEntry]
    scalars: list[CatalogEntry]
