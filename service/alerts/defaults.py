"""The shipped alert rules, on unless the rules file sets ``default_rules: false`` or overrides one by name."""

from __future__ import annotations

from quantwatch.service.alerts.specs import DEFAULT_DESCRIPTION, Rule

__all__ = ["DEFAULT_RULES"]

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
            "description": DEFAULT_DESCRIPTION,
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
        name="quantwatch_loss_divergence",
        scalar="loss / loss_shadow - 1",
        op=">",
        threshold=0.05,
        consecutive=3,
        severity="warning",
        annotations={
            "summary": "Loss of run ${run} diverges from the FP32 shadow by more than 5%",
            "description": DEFAULT_DESCRIPTION,
        },
    ),
)
"""Shipped rules, on unless the rules file sets ``default_rules: false`` or disables one by name."""


Loc = tuple[int | str, ...]
