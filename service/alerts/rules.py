"""Alert rules and receivers as data: the public names of the alerting part's rule vocabulary.

The models and their validation live in :mod:`~quantwatch.service.alerts.specs`, scalar expressions in
:mod:`~quantwatch.service.alerts.expressions`, the shipped rules in :mod:`~quantwatch.service.alerts.defaults` and the
YAML rules file in :mod:`~quantwatch.service.alerts.rules_file`; callers import them from here.
"""

from __future__ import annotations

from quantwatch.service.alerts.defaults import DEFAULT_RULES
from quantwatch.service.alerts.expressions import SCALARS, ScalarExpression
from quantwatch.service.alerts.rules_file import RulesFile, RulesFileError, load_rules_file, parse_rules_text
from quantwatch.service.alerts.specs import (
    METRICS,
    TEMPLATE_VARIABLES,
    Op,
    ReceiverSpec,
    Rule,
    breaches,
    render_template,
)

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
