"""The YAML rules file (``--rules FILE``, ``quantwatch rules check``): parsing, validation, line numbers."""

from __future__ import annotations

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantwatch.service.alerts.defaults import DEFAULT_RULES
from quantwatch.service.alerts.specs import ReceiverSpec, Rule

__all__ = ["Loc", "RulesFile", "RulesFileError", "load_rules_file", "parse_rules_text"]

Loc = tuple[int | str, ...]
"""Where in the file a problem is: keys and list positions from the root."""


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
