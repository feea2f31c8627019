"""Alert rules and receivers as data: the pydantic models, their validation and the YAML rules file.

A rule watches one *series kind*: a per-layer ``metric`` (``output_rel_l2``) or a per-run ``scalar``. A scalar rule may
name a derived expression over scalars instead of a single one, written in plain arithmetic:
``scalar: "loss / loss_shadow - 1"`` (operators ``+ - * /``, unary minus, parentheses, numbers and scalar names). A
step yields a sample of such an expression only when every scalar it names was reported at that step, so the shipped
"loss diverges from the FP32 shadow" rule stays silent for runs without a shadow. Division by zero follows IEEE 754
(``x/0`` is ``±inf``, ``0/0`` is NaN), and non-finite samples breach (see :func:`breaches`).

Annotations are :class:`string.Template` strings (``${run}``), restricted to :data:`TEMPLATE_VARIABLES`; anything else
is refused when the rule is created, so rendering never fails and never evaluates user code.
"""

from __future__ import annotations

import ast
import base64
import binascii
import fnmatch
import math
import operator
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from quantwatch.protocol import LAYER_METRICS
from quantwatch.protocol import SCALARS as CATALOG_SCALARS

__all__ = [
    "DEFAULT_RULES",
    "METRICS",
    "SCALARS",
    "TEMPLATE_VARIABLES",
    "Op",
    "ReceiverSpec",
    "Rule",
    "RulesFile",
    "RulesFileError",
    "ScalarExpression",
    "breaches",
    "load_rules_file",
    "parse_rules_text",
    "render_template",
]

METRICS: frozenset[str] = frozenset(LAYER_METRICS)
"""Canonical per-layer metric names (the protocol's catalogue)."""

SCALARS: frozenset[str] = frozenset(CATALOG_SCALARS)
"""Canonical per-run scalar names (the protocol's catalogue)."""

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
_DEFAULT_DESCRIPTION = (
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


_BIN_OPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: _ieee_div(a, b),
}


def _ieee_div(numerator: float, denominator: float) -> float:
    if denominator == 0.0:
        if numerator == 0.0 or math.isnan(numerator):
            return math.nan
        return math.copysign(math.inf, numerator) * math.copysign(1.0, denominator)
    return numerator / denominator


@dataclass(frozen=True)
class ScalarExpression:
    """A parsed arithmetic expression over scalar names (``loss / loss_shadow - 1``), evaluated without ``eval``."""

    text: str
    names: frozenset[str]
    _tree: ast.expr

    @classmethod
    def parse(cls, text: str) -> ScalarExpression:
        """Parse and validate ``text``; raises ``ValueError`` naming the problem."""
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"scalar: cannot parse expression {text!r}: {exc.msg}") from None
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                if node.id not in SCALARS:
                    raise ValueError(f"scalar: unknown scalar {node.id!r}; known: {', '.join(sorted(SCALARS))}")
                names.add(node.id)
            elif isinstance(node, ast.Constant):
                if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                    raise ValueError(f"scalar: only numbers may appear as constants, not {node.value!r}")
            elif isinstance(node, ast.BinOp):
                if type(node.op) not in _BIN_OPS:
                    raise ValueError("scalar: only + - * / are allowed in an expression")
            elif isinstance(node, ast.UnaryOp):
                if not isinstance(node.op, ast.USub | ast.UAdd):
                    raise ValueError("scalar: only unary + and - are allowed in an expression")
            elif not isinstance(node, ast.operator | ast.unaryop | ast.Load):
                raise ValueError(f"scalar: {type(node).__name__} is not allowed in an expression")
        if not names:
            raise ValueError("scalar: the expression must name at least one scalar")
        return cls(text=text, names=frozenset(names), _tree=tree)

    def evaluate(self, scalars: Mapping[str, float]) -> float | None:
        """The value at one step, or ``None`` when a scalar it names was not reported at that step."""
        if not self.names.issubset(scalars.keys()):
            return None
        return self._eval(self._tree, scalars)

    def _eval(self, node: ast.expr, scalars: Mapping[str, float]) -> float:
        if isinstance(node, ast.Name):
            return float(scalars[node.id])
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp):
            inner = self._eval(node.operand, scalars)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            return _BIN_OPS[type(node.op)](self._eval(node.left, scalars), self._eval(node.right, scalars))
        raise ValueError(f"scalar: {type(node).__name__} is not allowed in an expression")


def _default_annotations() -> dict[str, str]:
    return {"summary": _DEFAULT_SUMMARY, "description": _DEFAULT_DESCRIPTION}


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
    threshold: float = Field(description="Finite threshold; ratios as ratios (5% is 0.05).")
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

    @field_validator("runs")
    @classmethod
    def _check_runs(cls, value: str) -> str:
        return _check_glob(value, "runs")

    @field_validator("threshold")
    @classmethod
    def _check_threshold(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

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
        return self

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

    def matches_layer(self, layer: str) -> bool:
        """Whether this (metric) rule applies to ``layer``."""
        return any(fnmatch.fnmatchcase(layer, pattern) for pattern in self.layer_globs)

    def expression(self) -> ScalarExpression:
        """The parsed scalar expression of a scalar rule."""
        if self.scalar is None:
            raise ValueError(f"rule {self.name!r} is a metric rule, it has no scalar expression")
        return ScalarExpression.parse(self.scalar)


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


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        name="quantwatch_output_deviation",
        metric="output_rel_l2",
        op=">",
        threshold=0.05,
        consecutive=3,
        severity="warning",
        annotations={
            "summary": "Layer ${layer} of run ${run} deviates from its FP32 shadow by more than 5%",
            "description": _DEFAULT_DESCRIPTION,
        },
    ),
    Rule(
        name="quantwatch_nonfinite",
        metric="nonfinite_count",
        op=">",
        threshold=0.0,
        consecutive=1,
        severity="critical",
        annotations={
            "summary": "Non-finite values in layer ${layer} of run ${run}",
            "description": "${metric} was ${value} at step ${step} (ranks ${ranks}).",
        },
    ),
    Rule(
        name="quantwatch_rank_weight_mismatch",
        metric="rank_weight_mismatch",
        op=">",
        threshold=0.0,
        consecutive=1,
        severity="critical",
        annotations={
            "summary": "Ranks ${ranks} of run ${run} hold other weights in layer ${layer} than their replica group",
            "description": "${metric} was ${value} at step ${step}: data-parallel replicas that must agree do not.",
        },
    ),
    Rule(
        name="quantwatch_loss_divergence",
        scalar="loss / loss_shadow - 1",
        op=">",
        threshold=0.05,
        consecutive=3,
        severity="warning",
        annotations={
            "summary": "Loss of run ${run} diverges from the FP32 shadow by more than 5%",
            "description": _DEFAULT_DESCRIPTION,
        },
    ),
)
"""Shipped rules, on unless the rules file sets ``default_rules: false`` or disables one by name."""


Loc = tuple[int | str, ...]


class RulesFile(BaseModel):
    """The YAML rules file (``--rules FILE``): receivers, rules and whether the shipped defaults apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_rules: bool = True
    receivers: list[ReceiverSpec] = Field(default_factory=list)
    rules: list[Rule] = Field(default_factory=list)

    @field_validator("receivers")
    @classmethod
    def _unique_receivers(cls, value: list[ReceiverSpec]) -> list[ReceiverSpec]:
        _check_unique([receiver.name for receiver in value], "receiver")
        return value

    @field_validator("rules")
    @classmethod
    def _unique_rules(cls, value: list[Rule]) -> list[Rule]:
        _check_unique([rule.name for rule in value], "rule")
        return value

    def unknown_receivers(self) -> list[tuple[Loc, str]]:
        """Receivers named by a rule but not defined in this file, as ``(location, message)``."""
        known = {receiver.name for receiver in self.receivers}
        return [
            (("rules", index, "receivers", position), f"unknown receiver {name!r} (define it under `receivers:`)")
            for index, rule in enumerate(self.rules)
            for position, name in enumerate(rule.receivers)
            if name not in known
        ]

    def effective_rules(self) -> list[Rule]:
        """The rules to evaluate: the file's rules plus the defaults it does not override by name."""
        own = {rule.name for rule in self.rules}
        defaults = [rule for rule in DEFAULT_RULES if rule.name not in own] if self.default_rules else []
        return defaults + list(self.rules)


def _check_unique(names: list[str], kind: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"duplicate {kind} name {name!r}")
        seen.add(name)


class RulesFileError(ValueError):
    """A rules file is invalid; ``problems`` lists ``(line, location, message)``, line 1-based or 0 if unknown."""

    def __init__(self, problems: list[tuple[Loc, str]], *, lines: list[int] | None = None, source: str = "") -> None:
        self.locations = problems
        self.lines = lines if lines is not None else [0] * len(problems)
        self.source = source
        super().__init__(self.format())

    @property
    def problems(self) -> list[tuple[int, str, str]]:
        """``(line, dotted location, message)`` for each problem."""
        return [(line, _dotted(loc), message) for line, (loc, message) in zip(self.lines, self.locations, strict=True)]

    def format(self) -> str:
        """One line per problem: ``FILE:LINE: location: message``."""
        prefix = f"{self.source}:" if self.source else ""
        return "\n".join(
            f"{prefix}{line}: {where}: {message}" if where else f"{prefix}{line}: {message}"
            for line, where, message in self.problems
        )


def _dotted(loc: Loc) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _line_of(root: yaml.Node | None, loc: Loc) -> int:
    """The 1-based line of the deepest YAML node reachable along ``loc``."""
    node = root
    line = node.start_mark.line + 1 if node is not None else 0
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = None
            for key_node, value_node in node.value:
                if key_node.value == part:
                    found = value_node
                    line = key_node.start_mark.line + 1
                    break
            if found is None:
                break
            node = found
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def parse_rules_text(text: str, *, source: str = "") -> RulesFile:
    """Parse and validate a rules file's text; raises :class:`RulesFileError` with line numbers."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise RulesFileError(
            [((), f"not valid YAML: {getattr(exc, 'problem', None) or exc}")], lines=[line], source=source
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RulesFileError([((), "the rules file must be a mapping with `rules:`")], lines=[1], source=source)
    try:
        rules_file = RulesFile.model_validate(data)
    except ValidationError as exc:
        problems: list[tuple[Loc, str]] = []
        for error in exc.errors(include_input=False, include_url=False):
            loc = tuple(part for part in error["loc"] if not (isinstance(part, str) and part.startswith("function-")))
            problems.append((loc, _message(error["msg"])))
        lines = [_line_of(root, loc) for loc, _ in problems]
        raise RulesFileError(problems, lines=lines, source=source) from None
    unknown = rules_file.unknown_receivers()
    if unknown:
        raise RulesFileError(unknown, lines=[_line_of(root, loc) for loc, _ in unknown], source=source)
    return rules_file


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def load_rules_file(path: str) -> RulesFile:
    """Read and validate the rules file at ``path``; raises :class:`RulesFileError` (with line numbers) or OSError."""
    with open(path, encoding="utf-8") as handle:
        return parse_rules_text(handle.read(), source=path)
