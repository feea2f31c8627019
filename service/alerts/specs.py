"""Alert rules and receivers as data: the pydantic models and their validation.

A rule watches one *series kind*: a per-layer ``metric`` (``output_rel_l2``) or a per-run ``scalar``, which may be an
arithmetic expression over scalars (:mod:`~quantwatch.service.alerts.expressions`). Non-finite samples breach (see
:func:`breaches`).

Annotations are :class:`string.Template` strings (``${run}``), restricted to :data:`TEMPLATE_VARIABLES`; anything else
is refused when the rule is created, so rendering never fails and never evaluates user code.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import functools
import math
import operator
import re
import string
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from quantwatch.protocol import CATALOG, LAYER_METRICS
from quantwatch.service.alerts.expressions import SCALARS, ScalarExpression

__all__ = [
    "DEFAULT_DESCRIPTION",
    "METRICS",
    "TEMPLATE_VARIABLES",
    "Baseline",
    "Op",
    "ReceiverSpec",
    "Rule",
    "Selection",
    "breaches",
    "render_template",
    "selects_layer",
]

METRICS: frozenset[str] = frozenset(LAYER_METRICS)
"""Canonical per-layer metric names (the protocol's catalogue)."""


TEMPLATE_VARIABLES: frozenset[str] = frozenset(
    {"rule", "run", "layer", "metric", "op", "threshold", "value", "step", "consecutive", "ranks", "severity"}
)
"""The variables an annotation template may use, e.g. ``"${metric} = ${value} on ${layer}"``."""

Op = Literal[">", ">=", "<", "<="]
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
_LABEL_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HEADER_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
# Labels the evaluator sets itself; a rule may not shadow them.
_RESERVED_LABELS = frozenset({"alertname", "run", "layer", "metric", "severity"})
# Headers the signer or the HTTP client owns.
_RESERVED_HEADERS = frozenset({"content-type", "content-length", "host", "webhook-id", "webhook-timestamp"})
_RESERVED_HEADERS |= {"webhook-signature"}

_DEFAULT_SUMMARY = "${rule}: ${metric} ${op} ${threshold} on run ${run} ${layer}"
DEFAULT_DESCRIPTION = (
    "${metric} was ${value} at step ${step} (${op} ${threshold} for ${consecutive} consecutive reported steps; "
    "ranks ${ranks})."
)


def _check_name(value: str, what: str = "") -> str:
    # Rule and receiver names share one grammar: they become label values and URL path segments.
    if not _NAME_RE.fullmatch(value):
        raise ValueError(f"{what}must match [A-Za-z_][A-Za-z0-9_.:-]{{0,127}}")
    return value


def _check_label_name(key: str, kind: str) -> None:
    if not _LABEL_RE.fullmatch(key):
        raise ValueError(f"{kind} name {key!r} must match [A-Za-z_][A-Za-z0-9_]*")


_ObjectName = Annotated[str, AfterValidator(_check_name)]


def _check_finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


_Finite = Annotated[float, AfterValidator(_check_finite)]


def breaches(value: float, op: str, threshold: float) -> bool:
    """Whether one sample breaches ``value <op> threshold``.

    Non-finite values (NaN, ±inf) breach every rule: they mean the layer or the loss already broke, which is what
    every rule is there to catch, whatever its direction.
    """
    if not math.isfinite(value):
        return True
    return _OPS[op](value, threshold)


def _check_glob(pattern: str, field: str) -> str:
    if not pattern or len(pattern) > 512:
        raise ValueError(f"{field}: a glob of 1..512 characters is required")
    depth = 0
    for char in pattern:
        if char == "[":
            if depth:
                raise ValueError(f"{field}: nested '[' in glob {pattern!r}")
            depth = 1
        elif char == "]" and depth:
            depth = 0
    if depth:
        raise ValueError(f"{field}: unclosed '[' in glob {pattern!r}")
    try:
        re.compile(fnmatch.translate(pattern))
    except re.error as exc:
        raise ValueError(f"{field}: unparseable glob {pattern!r}: {exc}") from None
    return pattern


def _template_identifiers(text: str, field: str) -> set[str]:
    names: set[str] = set()
    for match in string.Template.pattern.finditer(text):
        if match.group("invalid") is not None:
            column = match.start("invalid")
            raise ValueError(f"{field}: invalid '$' placeholder at character {column} (use ${{name}} or $$)")
        name = match.group("named") or match.group("braced")
        if name is not None:
            names.add(name)
    return names


def _check_template(text: str, field: str) -> str:
    unknown = sorted(_template_identifiers(text, field) - TEMPLATE_VARIABLES)
    if unknown:
        allowed = ", ".join(sorted(TEMPLATE_VARIABLES))
        raise ValueError(f"{field}: unknown template variable(s) {', '.join(unknown)}; allowed: {allowed}")
    return text


def render_template(text: str, variables: Mapping[str, object]) -> str:
    """Render a validated annotation template; unknown names stay as written (``safe_substitute``)."""
    return string.Template(text).safe_substitute({key: str(value) for key, value in variables.items()})


def _check_globs(value: list[str] | None, field: str) -> list[str] | None:
    if value is None:
        return None
    if not 1 <= len(value) <= 64:
        raise ValueError(f"{field}: a list of 1..64 globs is required")
    return [_check_glob(pattern, f"{field}[{position}]") for position, pattern in enumerate(value)]


def _any_format(kinds: Mapping[str, str], patterns: tuple[str, ...], kind: str | None) -> bool:
    # Any tensor kind's format may match, unless the rule names the kind.
    values = list(kinds.values()) if kind is None else [kinds[kind]] if kind in kinds else []
    return any(fnmatch.fnmatchcase(value, pattern) for value in values for pattern in patterns)


class Baseline(BaseModel):
    """A bound relative to the series' own start: breach beyond ``factor`` × the median of its first ``samples``.

    For a cosine the deviation is ``1 - cosine``. The baseline starts again when the layer's format changes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples: int = Field(ge=1, le=10_000, description="Reported samples the median is taken over.")
    factor: _Finite = Field(gt=0, description="Breach when the deviation exceeds factor × the baseline median.")


Selection = tuple[tuple[str, ...], tuple[str, ...] | None, tuple[str, ...] | None, str | None]
"""A rule's layer selection: (layer globs, format globs, excluded format globs, tensor kind of the format globs)."""


def selects_layer(selection: Selection, layer: str, formats: Mapping[str, str] | None) -> bool:
    """Whether ``selection`` takes ``layer`` of ``formats`` (per tensor kind; ``None`` or empty: unknown).

    A layer of unknown format matches no format glob and is not excluded by an excluded one.
    """
    layer_globs, included, excluded, kind = selection
    if not any(fnmatch.fnmatchcase(layer, pattern) for pattern in layer_globs):
        return False
    if included is not None and (not formats or not _any_format(formats, included, kind)):
        return False
    return not (excluded is not None and formats and _any_format(formats, excluded, kind))


_OPTIONAL_FIELDS = frozenset({"formats", "exclude_formats", "format_kind", "baseline"})


def _default_annotations() -> dict[str, str]:
    return {"summary": _DEFAULT_SUMMARY, "description": DEFAULT_DESCRIPTION}


class Rule(BaseModel):
    """One alert rule: ``<metric|scalar> <op> <threshold>`` for ``consecutive`` reported steps of a series.

    An episode is per (rule, run, layer): one alert however many ranks breach. It fires when a series has breached
    on ``consecutive`` consecutive reported samples, and resolves at the ``keep_firing_for + 1``-th consecutive
    non-breaching sample (``keep_firing_for`` is hysteresis against flapping, counted in reported steps).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: _ObjectName = Field(description="Unique rule name; becomes the `alertname` label.")
    metric: str | None = Field(default=None, description="Per-layer metric to watch (exclusive with `scalar`).")
    scalar: str | None = Field(
        default=None,
        description="Per-run scalar, or an arithmetic expression over scalars such as `loss / loss_shadow - 1`.",
    )
    layers: str | list[str] = Field(
        default="*",
        description="Glob over layer names, or a list of globs of which any may match (metric rules only).",
    )
    runs: str = Field(default="*", description="Glob over run names.")
    op: Op = Field(description="Comparison: `>`, `>=`, `<` or `<=`.")
    threshold: _Finite = Field(description="Finite threshold; ratios as ratios (5% is 0.05).")
    formats: list[str] | None = Field(
        default=None,
        description="Globs over layer formats (`fp8*`, `nvfp4`): only layers with a matching format (metric rules).",
    )
    exclude_formats: list[str] | None = Field(
        default=None, description="Globs over layer formats: layers with a matching format are left out."
    )
    format_kind: Literal["weight", "input", "grad"] | None = Field(
        default=None, description="Match the format globs against this tensor kind only (default: any kind)."
    )
    baseline: Baseline | None = Field(
        default=None,
        description="Also require the sample to exceed `factor` × the median of the series' first `samples` samples.",
    )
    consecutive: int = Field(default=3, ge=1, le=100_000, description="Consecutive breaching reported steps to fire.")
    keep_firing_for: int = Field(
        default=0, ge=0, le=100_000, description="Non-breaching reported steps tolerated before resolving."
    )
    severity: Literal["info", "warning", "critical"] = "warning"
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on the alert.")
    annotations: dict[str, str] = Field(
        default_factory=_default_annotations, description="Templated annotations (`${run}`, `${value}`, ...)."
    )
    receivers: list[str] = Field(default_factory=list, description="Receiver names; empty means every receiver.")
    enabled: bool = True

    @field_validator("metric")
    @classmethod
    def _check_metric(cls, value: str | None) -> str | None:
        if value is not None and value not in METRICS:
            raise ValueError(f"unknown metric {value!r}; known: {', '.join(sorted(METRICS))}")
        return value

    @field_validator("scalar")
    @classmethod
    def _check_scalar(cls, value: str | None) -> str | None:
        if value is not None:
            ScalarExpression.parse(value)
        return value

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            return _check_glob(value, "layers")
        if not 1 <= len(value) <= 64:
            raise ValueError("layers: a list of 1..64 globs is required")
        return [_check_glob(pattern, f"layers[{position}]") for position, pattern in enumerate(value)]

    @field_validator("formats")
    @classmethod
    def _check_formats(cls, value: list[str] | None) -> list[str] | None:
        return _check_globs(value, "formats")

    @field_validator("exclude_formats")
    @classmethod
    def _check_exclude_formats(cls, value: list[str] | None) -> list[str] | None:
        return _check_globs(value, "exclude_formats")

    @field_validator("runs")
    @classmethod
    def _check_runs(cls, value: str) -> str:
        return _check_glob(value, "runs")

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            _check_label_name(key, "label")
            if key in _RESERVED_LABELS:
                raise ValueError(f"label {key!r} is set by QuantWatch itself")
        return value

    @field_validator("annotations")
    @classmethod
    def _check_annotations(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            _check_label_name(key, "annotation")
            _check_template(text, f"annotations.{key}")
        return value

    @field_validator("receivers")
    @classmethod
    def _check_receivers(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_name(name, f"receiver name {name!r} ")
        if len(set(value)) != len(value):
            raise ValueError("receiver names must be unique")
        return value

    @model_validator(mode="after")
    def _check_kind(self) -> Rule:
        if (self.metric is None) == (self.scalar is None):
            raise ValueError("exactly one of `metric` or `scalar` is required")
        if self.scalar is not None and self.layers != "*":
            raise ValueError("`layers` applies to metric rules only; a scalar rule watches the whole run")
        for name in ("formats", "exclude_formats", "format_kind", "baseline"):
            if self.scalar is not None and getattr(self, name) is not None:
                raise ValueError(f"`{name}` applies to metric rules only; a scalar rule watches the whole run")
        if self.format_kind is not None and self.formats is None and self.exclude_formats is None:
            raise ValueError("`format_kind` applies with `formats` or `exclude_formats`")
        if self.baseline is not None and self.metric is not None:
            measure = CATALOG[self.metric]
            if measure.polarity == "lower_is_worse" and measure.unit != "cosine":
                raise ValueError(f"`baseline` needs a higher-is-worse metric or a cosine; {self.metric} is neither")
            worse = ("<", "<=") if measure.polarity == "lower_is_worse" else (">", ">=")
            if self.op not in worse:
                raise ValueError(f"a baseline rule compares in the worse direction of {self.metric}: op {worse[0]!r}")
        return self

    def definition(self) -> dict[str, Any]:
        """The rule as stored (JSON); the format and baseline fields only when set, so rules stored before they
        existed compare equal to their unchanged definition."""
        dumped = self.model_dump(mode="json")
        return {key: value for key, value in dumped.items() if key not in _OPTIONAL_FIELDS or value is not None}

    def deviation(self, value: float) -> float:
        """How far a sample is from perfect in the worse direction: the value, or ``1 - value`` for a cosine."""
        return 1.0 - value if self.on_cosine else value

    @property
    def on_cosine(self) -> bool:
        """Whether the rule watches a cosine (whose deviation is ``1 - cosine``)."""
        return self.metric is not None and CATALOG[self.metric].unit == "cosine"

    def warnings(self) -> list[str]:
        """What is valid but probably not meant: a scalar outside the catalogue (fine when runs send it), a
        threshold above 1 on a ratio metric (ratios are stored as ratios: 5% is 0.05)."""
        found: list[str] = []
        if self.scalar is not None:
            for name in sorted(self.expression().names - SCALARS):
                if not name.startswith("agent_"):
                    found.append(f"{self.name}: scalar {name!r} is not catalogued; the rule waits for runs to send it")
        measure = CATALOG.get(self.metric) if self.metric is not None else None
        if measure is not None and measure.is_ratio and abs(self.threshold) > 1:
            found.append(
                f"{self.name}: threshold {self.threshold:g} on the ratio {self.metric} looks like a percentage; "
                f"ratios are stored as ratios (5% is 0.05)"
            )
        return found

    def describe(self) -> str:
        """One line saying what the rule watches, e.g. for ``quantwatch rules check``."""
        where = f"{self.series} {self.op} {self.threshold:g}"
        if self.baseline is not None:
            where += f" and beyond {self.baseline.factor:g} × the median of its first {self.baseline.samples} samples"
            where += " (of 1 - cosine)" if self.on_cosine else ""
        parts = [f"{self.name}: {where} for {self.consecutive} step(s)"]
        if self.keep_firing_for:
            parts.append(f"resolves after {self.keep_firing_for + 1} calm step(s)")
        if self.layer_globs != ("*",):
            parts.append(f"layers {', '.join(self.layer_globs)}")
        kind = f" ({self.format_kind})" if self.format_kind is not None else ""
        if self.formats is not None:
            parts.append(f"formats {', '.join(self.formats)}{kind}")
        if self.exclude_formats is not None:
            parts.append(f"except formats {', '.join(self.exclude_formats)}{kind}")
        parts.append(self.severity + ("" if self.enabled else ", disabled"))
        return "; ".join(parts)

    @property
    def series(self) -> str:
        """The watched metric name or scalar expression, as shown in labels and annotations."""
        return self.metric if self.metric is not None else str(self.scalar)

    def matches_run(self, run: str) -> bool:
        """Whether this rule applies to ``run``."""
        return fnmatch.fnmatchcase(run, self.runs)

    @property
    def layer_globs(self) -> tuple[str, ...]:
        """The globs of ``layers``, of which any may match."""
        return (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)

    @property
    def selects_formats(self) -> bool:
        """Whether the rule selects layers by format."""
        return self.formats is not None or self.exclude_formats is not None

    @property
    def selection(self) -> Selection:
        """What selects the rule's layers: (layer globs, format globs, excluded format globs, tensor kind)."""
        formats = tuple(self.formats) if self.formats is not None else None
        excluded = tuple(self.exclude_formats) if self.exclude_formats is not None else None
        return self.layer_globs, formats, excluded, self.format_kind

    def matches_layer(self, layer: str, formats: Mapping[str, str] | None = None) -> bool:
        """Whether this (metric) rule applies to ``layer`` of ``formats`` (per tensor kind; ``None``: unknown)."""
        return selects_layer(self.selection, layer, formats)

    def expression(self) -> ScalarExpression:
        """The parsed scalar expression of a scalar rule."""
        if self.scalar is None:
            raise ValueError(f"rule {self.name!r} is a metric rule, it has no scalar expression")
        return _parsed_expression(self.scalar)


@functools.lru_cache(maxsize=256)
def _parsed_expression(text: str) -> ScalarExpression:
    # A scalar rule is evaluated on every batch: parsing its text each time was a tenth of the alert engine's cost.
    return ScalarExpression.parse(text)


def _check_whsec(secret: str) -> bytes:
    # Standard Webhooks: "whsec_" + base64 of 24..64 random bytes. Never echo the secret in an error.
    if not secret.startswith("whsec_"):
        raise ValueError("a webhook secret must start with 'whsec_'")
    try:
        key = base64.b64decode(secret[len("whsec_") :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret must be 'whsec_' followed by base64") from None
    if not 24 <= len(key) <= 64:
        raise ValueError("a webhook secret must hold 24..64 bytes of key material")
    return key


class ReceiverSpec(BaseModel):
    """Where notifications go: a signed ``webhook`` or an ``alertmanager`` (pushed to ``<url>/api/v2/alerts``).

    ``secrets`` are write-only (never returned by the API, never logged). Every secret signs each webhook, so a
    receiver can roll its secret: add the new one, switch the receiver over, remove the old one.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: _ObjectName = Field(description="Unique receiver name, referenced by rules.")
    type: Literal["webhook", "alertmanager"] = "webhook"
    url: str = Field(description="http(s) URL; for `alertmanager`, the base URL of the Alertmanager.")
    secrets: list[SecretStr] = Field(default_factory=list, description="Standard Webhooks secrets (`whsec_...`).")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra HTTP headers on every request.")
    timeout_seconds: float = Field(default=5.0, gt=0, le=60, description="Per-request timeout.")
    send_resolved: bool = Field(default=True, description="Also notify when an episode resolves.")
    enabled: bool = True

    @model_validator(mode="before")
    @classmethod
    def _single_secret(cls, data: Any) -> Any:
        if isinstance(data, dict) and "secret" in data:
            data = dict(data)
            secret = data.pop("secret")
            if "secrets" in data:
                raise ValueError("give either `secret` or `secrets`, not both")
            data["secrets"] = [] if secret is None else [secret]
        return data

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username or parts.password:
            raise ValueError("must not carry credentials; use `headers` or `secrets`")
        return value

    @field_validator("secrets")
    @classmethod
    def _check_secrets(cls, value: list[SecretStr]) -> list[SecretStr]:
        for secret in value:
            _check_whsec(secret.get_secret_value())
        return value

    @field_validator("headers")
    @classmethod
    def _check_headers(cls, value: dict[str, str]) -> dict[str, str]:
        for key, header_value in value.items():
            if not _HEADER_RE.fullmatch(key):
                raise ValueError(f"header name {key!r} is not a valid HTTP token")
            if key.lower() in _RESERVED_HEADERS:
                raise ValueError(f"header {key!r} is set by QuantWatch itself")
            if "\r" in header_value or "\n" in header_value:
                raise ValueError(f"header {key!r}: value must not contain line breaks")
        return value

    @model_validator(mode="after")
    def _check_type(self) -> ReceiverSpec:
        if self.type == "alertmanager" and self.secrets:
            raise ValueError("`secrets` apply to webhook receivers; Alertmanager does not verify signatures")
        return self

    def secret_keys(self) -> list[bytes]:
        """The decoded HMAC keys of the secrets, in order."""
        return [_check_whsec(secret.get_secret_value()) for secret in self.secrets]
