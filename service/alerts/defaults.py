"""The shipped alert rules, on unless the rules file sets ``default_rules: false`` or overrides one by name.

They hold for every number format: the update rules watch every layer; output deviation has a fixed 5% bound for
8-bit layers (and layers of unknown format, from agents that do not send ``layer_formats``), and a bound relative to
the layer's own start for 6- and 4-bit layers, whose quantization alone costs 6-14% of output deviation.
"""

from __future__ import annotations

import math

from quantwatch.service.alerts.specs import DEFAULT_DESCRIPTION, Baseline, Rule

__all__ = ["DEFAULT_RULES", "LOW_BIT_FORMATS", "UPDATE_NOISE_BOUND", "shipped_rules_table"]

LOW_BIT_FORMATS: tuple[str, ...] = ("fp6*", "fp4*", "mxfp6*", "mxfp4*", "nvfp4*", "int4*")
"""Globs of the 6- and 4-bit formats (any tensor kind of a layer in one of them makes it a low-bit layer)."""

UPDATE_NOISE_BOUND = 1 / math.sqrt(3)
"""``update_rel_l2`` beyond which quantized training stops being effective ("FP4 All the Way", arXiv 2505.19115:
once the gradient norm falls below about √3 times the quantization noise)."""


def _output_deviation(
    name: str,
    summary: str,
    description: str,
    *,
    formats: list[str] | None = None,
    exclude_formats: list[str] | None = None,
    baseline: Baseline | None = None,
) -> Rule:
    """``output_rel_l2`` above 5% for 3 consecutive reported steps, in the layers the format globs select."""
    return Rule(
        name=name,
        metric="output_rel_l2",
        op=">",
        threshold=0.05,
        consecutive=3,
        formats=formats,
        exclude_formats=exclude_formats,
        baseline=baseline,
        severity="warning",
        annotations={"summary": summary, "description": description},
    )


def _any_nonzero(name: str, metric: str, summary: str, description: str) -> Rule:
    """A critical alert from the first reported step on which ``metric`` is above 0."""
    return Rule(
        name=name,
        metric=metric,
        op=">",
        threshold=0.0,
        consecutive=1,
        severity="critical",
        annotations={"summary": summary, "description": description},
    )


DEFAULT_RULES: tuple[Rule, ...] = (
    _output_deviation(
        "quantwatch_output_deviation",
        "Layer ${layer} of run ${run} deviates from its FP32 shadow by more than 5%",
        DEFAULT_DESCRIPTION,
        exclude_formats=list(LOW_BIT_FORMATS),
    ),
    _output_deviation(
        "quantwatch_output_deviation_low_bit",
        "Low-bit layer ${layer} of run ${run} deviates from its FP32 shadow twice as much as it did at its start",
        "output_rel_l2 was ${value} at step ${step}: above 5% and above twice the median of its first 5 samples in "
        "this format, for ${consecutive} consecutive reported steps (ranks ${ranks}).",
        formats=list(LOW_BIT_FORMATS),
        baseline=Baseline(samples=5, factor=2.0),
    ),
    Rule(
        name="quantwatch_update_direction",
        metric="update_cosine",
        op="<",
        threshold=0.95,
        consecutive=3,
        keep_firing_for=9,
        severity="warning",
        annotations={
            "summary": "The weight update of layer ${layer} in run ${run} points more than 5% away from FP32",
            "description": "update_cosine was ${value} at step ${step} (< 0.95 for ${consecutive} consecutive "
            "reported steps; resolves once it stays >= 0.95 for 10; ranks ${ranks}).",
        },
    ),
    Rule(
        name="quantwatch_update_noise",
        metric="update_rel_l2",
        op=">",
        threshold=round(UPDATE_NOISE_BOUND, 4),
        consecutive=3,
        severity="warning",
        annotations={
            "summary": "Quantization noise dominates the weight gradient of layer ${layer} in run ${run}",
            "description": "update_rel_l2 was ${value} at step ${step} (> 1/√3 for ${consecutive} consecutive "
            "reported steps; ranks ${ranks}). Quantized training stops being effective once the gradient norm "
            "falls below about √3 times the quantization noise (FP4 All the Way, arXiv 2505.19115).",
        },
    ),
    _any_nonzero(
        "quantwatch_nonfinite",
        "nonfinite_count",
        "Non-finite values in layer ${layer} of run ${run}",
        "${metric} was ${value} at step ${step} (ranks ${ranks}).",
    ),
    _any_nonzero(
        "quantwatch_rank_weight_mismatch",
        "rank_weight_mismatch",
        "Ranks ${ranks} of run ${run} hold other weights in layer ${layer} than their replica group",
        "${metric} was ${value} at step ${step}: data-parallel replicas that must agree do not.",
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


def shipped_rules_table() -> str:
    """The Markdown table of :data:`DEFAULT_RULES` that README.md shows (a test keeps the two the same)."""
    lines = ["| rule | what it watches |", "|---|---|"]
    for rule in DEFAULT_RULES:
        watches = rule.describe().split(": ", 1)[1].replace("*", "\\*")  # a glob's * is not Markdown emphasis
        lines.append(f"| `{rule.name}` | {watches} |")
    return "\n".join(lines)
