"""Number formats, quantizers, fused error statistics and quantized layers.

The plain-torch reference (`quantwatch.kernels.reference`) is the source of truth; `quantize` picks a fused fast
path (native kernels or ``torch.compile`` on CPU, Triton on CUDA) by `Backend` and falls back to the reference.
"""

from .api import AUTO_COMPILE_MIN_NUMEL, AUTO_NATIVE_MIN_NUMEL, quantize
from .conv1d import QuantConv1D
from .convert import QuantConfig, Recipe, quantize_model
from .formats import FORMATS, PRESETS, FormatSpec, Preset
from .layers import Observer, QuantLinear
from .options import Backend, BackendUnavailableError, Rounding, Scaling, ScalingSpec, parse_scaling
from .quantizer import Quantizer, QuantSpec
from .reference import QuantDetails
from .stats import ErrorStats, StatsBatch, error_stats

__all__ = [
    "AUTO_COMPILE_MIN_NUMEL",
    "AUTO_NATIVE_MIN_NUMEL",
    "FORMATS",
    "PRESETS",
    "Backend",
    "BackendUnavailableError",
    "ErrorStats",
    "FormatSpec",
    "Observer",
    "Preset",
    "QuantConfig",
    "QuantConv1D",
    "QuantDetails",
    "QuantLinear",
    "QuantSpec",
    "Quantizer",
    "Recipe",
    "Rounding",
    "Scaling",
    "ScalingSpec",
    "StatsBatch",
    "error_stats",
    "parse_scaling",
    "quantize",
    "quantize_model",
]
