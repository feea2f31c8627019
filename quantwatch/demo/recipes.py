"""The demo's recipes (which layers get which number format) and the rules file that adds its webhook receiver."""

from __future__ import annotations

from typing import Any

from quantwatch.kernels import QuantConfig, QuantSpec, Recipe

# The layer the demo recipe quantizes to plain FP4 with one scale for the whole tensor.
PER_TENSOR_FP4_LAYER = "blocks.1.mlp.fc2"
# The shipped rule the per-tensor FP4 layer breaks: its update direction more than 5% off FP32, 3 steps in a row.
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


# Per recipe, the globs of its FP8 layers and of its NVFP4 layers.
FORMAT_LAYERS: dict[str, tuple[list[str], list[str]]] = {
    "mixed": (["*.attn.*", "head"], ["*.mlp.*"]),
    "fp8": (["*"], []),
    "fp4": (["head"], ["blocks.*"]),
}


def receiver_rules(receiver_url: str, secret: str) -> dict[str, Any]:
    """The rules file the demo's collector starts with: the shipped rules, unmodified, and the demo's receiver."""
    return {"receivers": [{"name": "demo-webhook", "url": receiver_url, "secret": secret}]}


def make_recipe(name: str) -> Recipe:
    """The demo's quantization recipe ``name`` (one of :data:`RECIPES`); ``ValueError`` names the choices.

    In ``mixed`` the per-tensor FP4 layer comes first (the first matching glob wins).
    """
    if name not in FORMAT_LAYERS:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    fp8_layers, fp4_layers = FORMAT_LAYERS[name]
    per_tensor = [(PER_TENSOR_FP4_LAYER, _FP4_PER_TENSOR)] if name == "mixed" else []
    return Recipe(rules=[*((glob, _FP8) for glob in fp8_layers), *per_tensor, *((glob, _NVFP4) for glob in fp4_layers)])
