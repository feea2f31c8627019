"""Adapters: what the agent recognises in a model and how it measures each kind of quantized layer.

Built in: QuantWatch's own layers (the reference-forward protocol), torch.ao eager QAT, torchao float8 training
(``Float8Linear``), torchao QAT (``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding`` and the prototype MX / NVFP4
fake-quantized linears), torchao MXFP8 training (by the weight's type), NVFP4 training (``NVFP4Linear``) and INT8
mixed-precision training (both variants). Register your own with :func:`register_adapter`.
"""

from quantwatch.agent.adapters.discovery import (
    AdapterHandle,
    build_layer_adapters,
    dequantize_shadow,
    find_layers,
    register_adapter,
    registered_adapters,
)
from quantwatch.agent.adapters.linear import CastResult, RecomputedCastLinear, ShadowedLayer
from quantwatch.agent.adapters.registry import (
    FORMAT_KINDS,
    HIGH_PRECISION,
    Adapter,
    AdapterContext,
    Found,
    LayerInfo,
    UnsupportedLayerError,
)
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_WEIGHT

__all__ = [
    "FORMAT_KINDS",
    "HIGH_PRECISION",
    "KIND_GRAD",
    "KIND_INPUT",
    "KIND_WEIGHT",
    "Adapter",
    "AdapterContext",
    "AdapterHandle",
    "CastResult",
    "Found",
    "LayerInfo",
    "RecomputedCastLinear",
    "ShadowedLayer",
    "UnsupportedLayerError",
    "build_layer_adapters",
    "dequantize_shadow",
    "find_layers",
    "register_adapter",
    "registered_adapters",
]
