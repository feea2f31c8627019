"""The demo's recipes (which layers get which number format) and the alert rules tuned to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantwatch.kernels import QuantConfig, QuantSpec, Recipe
from quantwatch.service.alerts.rules import DEFAULT_RULES, Rule

# The layer the demo recipe quantizes to plain FP4 with one scale for the whole tensor.
PER_TENSOR_FP4_LAYER = "blocks.1.mlp.fc2"
# The demo's own rule: the update direction of a layer more than 5% off its FP32 reference, 3 steps in a row.
UPDATE_RULE = "quantwatch_update_direction"

_FP8 = QuantConfig(weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
_NVFP4 = QuantConfig(weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4"), grad=QuantSpec("fp8_e5m2"))
_FP4_PER_TENSOR = QuantConfig(
    weight=QuantSpec("fp4_e2m1", scaling="tensor"),
    input=QuantSpec("fp4_e2m1", scaling="tensor"),
    grad=QuantSpec("fp4_e2m1", scaling="tensor"),
)

RECIPES: dict[str, str] = {
    "mixed": "FP8 attention and head, NVFP4 MLPs, per-tensor FP4 (gradients too) on blocks.1.mlp.fc2",
    "fp8": "FP8 (E4M3 forward, E5M2 gradients) everywhere",
    "fp4": "NVFP4 everywhere but the FP8 head",
}


# Per recipe, the globs of its FP8 layers and of its FP4 layers: what the demo's alert thresholds are scoped by.
FORMAT_LAYERS: dict[str, tuple[list[str], list[str]]] = {
    "mixed": (["*.attn.*", "head"], ["*.mlp.*"]),
    "fp8": (["*"], []),
    "fp4": (["head"], ["blocks.*"]),
}
# FP4 quantization itself costs 6-14% of output deviation on this model (NVFP4 weights and inputs): a 5% bound suits FP8
# layers only. The FP4 layers get a bound well above their own normal.
FP4_OUTPUT_THRESHOLD = 0.25


def demo_rules(recipe: str, receiver_url: str, secret: str) -> dict[str, Any]:
    """The rules file the demo's collector starts with: the shipped rules, tuned for ``recipe``, and one receiver.

    The shipped 5% output-deviation rule keeps its name and is scoped to the FP8 layers; FP4 layers get
    :data:`FP4_OUTPUT_THRESHOLD`; and :data:`UPDATE_RULE` watches every layer's update direction (``update_cosine``
    below 0.95, i.e. more than 5% off the FP32 reference, for 3 reported steps; firing until 11 steps in a row are
    back above): the rule the drifting per-tensor FP4 layer breaks. This is how a user tunes the shipped rules to a
    recipe: same names, narrower layers.
    """
    fp8_layers, fp4_layers = FORMAT_LAYERS[recipe]
    output_rule = next(rule for rule in DEFAULT_RULES if rule.name == "quantwatch_output_deviation")
    rules = [
        output_rule.model_copy(update={"layers": fp8_layers}),
        Rule(
            name=UPDATE_RULE,
            metric="update_cosine",
            op="<",
            threshold=0.95,
            consecutive=3,
            # The drift is noisy step to step: one alert for the episode, not one per dip back above 0.95.
            keep_firing_for=10,
            annotations={
                "summary": "The weight update of layer ${layer} in run ${run} points more than 5% away from FP32",
                "description": "update_cosine was ${value} at step ${step} (< 0.95 for 3 consecutive steps).",
            },
        ),
    ]
    if fp4_layers:
        summary = "FP4 layer ${layer} of run ${run} deviates from its FP32 shadow by more than ${threshold}"
        rules.append(
            output_rule.model_copy(
                update={
                    "name": "demo_fp4_output_deviation",
                    "layers": fp4_layers,
                    "threshold": FP4_OUTPUT_THRESHOLD,
                    "annotations": {**output_rule.annotations, "summary": summary},
                }
            )
        )
    return {
        "default_rules": True,
        "rules": [rule.model_dump(mode="json") for rule in rules],
        "receivers": [{"name": "demo-webhook", "url": receiver_url, "secret": secret}],
    }


def kept_rules_path(database: Path) -> Path:
    """Where the demo leaves its rules (without the receiver, which lives only as long as the demo) next to its
    database, so that ``quantwatch serve --rules`` shows the history under the same rules: served without them, the
    collector would retire the demo's rules and their alerts with them."""
    return database.with_name(f"{database.stem}.rules.yaml")


def make_recipe(name: str) -> Recipe:
    """The demo's quantization recipe ``name`` (one of :data:`RECIPES`); ``ValueError`` names the choices.

    The layers of each format are those :func:`demo_rules` scopes its thresholds by; in ``mixed`` the per-tensor FP4
    layer comes first (the first matching glob wins).
    """
    if name not in FORMAT_LAYERS:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    fp8_layers, fp4_layers = FORMAT_LAYERS[name]
    per_tensor = [(PER_TENSOR_FP4_LAYER, _FP4_PER_TENSOR)] if name == "mixed" else []
    return Recipe(rules=[*((glob, _FP8) for glob in fp8_layers), *per_tensor, *((glob, _NVFP4) for glob in fp4_layers)])
