"""The built-in adapters, in the order they are asked (after the users' own)."""

from __future__ import annotations

from quantwatch.agent.adapters.quantwatch_layers import ReferenceForwardAdapter, TorchAoEagerQatAdapter
from quantwatch.agent.adapters.registry import Adapter
from quantwatch.agent.adapters.torchao_float8 import Float8LinearAdapter, Float8TrainingWeightAdapter
from quantwatch.agent.adapters.torchao_int8 import Int8MixedPrecisionTrainingAdapter
from quantwatch.agent.adapters.torchao_mx import MXFP8TrainingAdapter, NVFP4TrainingAdapter, PrototypeQatAdapter
from quantwatch.agent.adapters.torchao_qat import TorchAoQatAdapter

__all__ = ["BUILTIN_ADAPTERS"]

BUILTIN_ADAPTERS: tuple[Adapter, ...] = (
    ReferenceForwardAdapter(),
    TorchAoEagerQatAdapter(),
    Float8LinearAdapter(),
    TorchAoQatAdapter(),
    PrototypeQatAdapter(),
    MXFP8TrainingAdapter(),
    Float8TrainingWeightAdapter(),
    NVFP4TrainingAdapter(),
    Int8MixedPrecisionTrainingAdapter(),
)
