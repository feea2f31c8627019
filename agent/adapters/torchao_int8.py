"""torchao INT8 mixed-precision training (prototype): ``quantize_(m, Int8MixedPrecisionTrainingConfig())``.

The layer stays an ``nn.Linear`` whose weight is an ``Int8MixedPrecisionTrainingLinearWeight`` (the high-precision
weight in ``_data``, the config in ``config``), or, with ``module_swap=True``, becomes an
``Int8MixedPrecisionTrainingLinear`` (the config in ``config``).  Each of its three GEMMs casts both operands to INT8
with one absmax scale per row (``quantize_int8_rowwise``: scale ``amax/127``, round half to even), unless the
config's flag of that GEMM (``output``, ``grad_input``, ``grad_weight``) keeps it in high precision.  Which cast each
metric reports:

* ``weight_rel_l2``: the forward GEMM's weight cast, one scale per output channel (``int8:channel``);
* ``act_rel_l2``, the ratios, ``amax``, ``scale``: the forward GEMM's input cast, one scale per token
  (``int8:token``);
* ``grad_rel_l2``: the input-gradient GEMM's output-gradient cast, one scale per token (``int8:token``);
* a kind whose GEMM the config keeps in high precision is ``high_precision`` and has no figure.  The
  weight-gradient GEMM's casts (along the tokens) are not reported; ``update_cosine`` shows their effect.

torchao 0.18's weight wrapper registers its ``F.linear`` override where only ``__torch_dispatch__`` looks (its
``implements`` no longer covers torch functions), so ``F.linear`` on it runs the plain high-precision ``mm``, forward
and backward: such a layer is reported ``high_precision`` for every kind (a warning says so once) and measured as
one.  Whether the wrapper computes in INT8 is probed once per class and device type on a product whose INT8 result
differs from the exact one, so a torchao that wires it again is measured as INT8 without a change here.

The casts measured are the layer's own: on a sampled step the ``quantize_int8_rowwise`` that ``_dynamic_int8_mm``
calls is wrapped (:mod:`~quantwatch.agent.adapters.capture`) and each cast a ``module_swap`` layer makes is handed to
its measurer, so none is made twice (tested: a sampled step makes as many casts as an unsampled one).  The one cast
a layer does not make, the input-gradient GEMM's of a layer whose input needs no gradient (the first layer's), is
recomputed for ``grad_rel_l2``, as are all the casts of a weight-wrapper layer and of a torchao whose functions this
wrapper cannot reach; recomputed with torchao's own ``quantize_int8_rowwise`` (deterministic rounding: the very
values the layer computes with), the weight cast in the weight's own dtype (the layer's is its input's: the same
unless CUDA autocast or mixed parameter dtypes make them differ).  ``scale`` is the dequantization scale
``amax/127`` (largest over tokens).

``qw.actions.keep_high_precision`` switches a layer by giving it a config of its own (other layers keep the object
``quantize_`` shared between them): None sets every flag off, ``"int8"`` every flag on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.functional import linear

from quantwatch.agent.adapters.capture import CapturedCastLinear, CastCapture
from quantwatch.agent.adapters.linear import (
    INT8_TRAINING_WEIGHT,
    Cast,
    CastResult,
    RecomputedCastLinear,
    high_precision_data,
)
from quantwatch.agent.adapters.registry import (
    HIGH_PRECISION,
    Adapter,
    AdapterContext,
    UnsupportedLayerError,
    loaded_classes,
)
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_WEIGHT, LayerAdapter

__all__ = [
    "INT8_TRAINING_FORMAT",
    "Int8MixedPrecisionTrainingAdapter",
    "computes_int8",
    "int8_training_config",
    "set_int8_gemms",
]

INT8_TRAINING_FORMAT = "int8"
"""The format name ``keep_high_precision`` takes to switch a layer's INT8 GEMMs on again."""

logger = logging.getLogger("quantwatch.agent")

_MODULE = "torchao.prototype.quantized_training.int8_mixed_precision"
_FLAGS = ("output", "grad_input", "grad_weight")
#: Per kind, the config flag of the GEMM whose cast is reported and that cast's format.
_REPORTED = {
    "weight": ("output", "int8:channel"),
    "input": ("output", "int8:token"),
    "grad": ("grad_input", "int8:token"),
}
_KINDS = {"weight": KIND_WEIGHT, "input": KIND_INPUT, "grad": KIND_GRAD}


def _weight_classes() -> tuple[type, ...]:
    return loaded_classes(INT8_TRAINING_WEIGHT)


def _module_classes() -> tuple[type, ...]:
    return loaded_classes(f"{_MODULE}:Int8MixedPrecisionTrainingLinear")


def _holder(module: nn.Module) -> Any:
    """What holds the layer's config: the weight wrapper, or the swapped module itself."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, _weight_classes()) else module


#: Per (weight wrapper class, device type), whether it computes in INT8 (`_wrapper_computes_int8`).
_PROBED: dict[tuple[type, str], bool] = {}


def _wrapper_computes_int8(wrapper: type, config_type: type, device: torch.device) -> bool:
    """Whether ``F.linear`` on a ``wrapper`` weight of an all-INT8 ``config_type`` runs torchao's INT8 GEMM on
    ``device``: every weight row (1, 0.004, 0, …) casts to (1, 1/127, 0, …) (0.508 rounds to 1), so its INT8 product
    with the input rows (0, 1, 0, …), cast exactly, is 1/127 where the exact one is 0.004.  32 × 32, as CUDA's
    ``_int_mm`` wants."""
    key = (wrapper, device.type)
    if key in _PROBED:
        return _PROBED[key]
    weight = torch.zeros(32, 32, device=device)
    weight[:, 0], weight[:, 1] = 1.0, 0.004
    x = torch.zeros(32, 32, device=device)
    x[:, 1] = 1.0
    try:
        with torch.no_grad():
            out = linear(x, wrapper(weight, config_type(**dict.fromkeys(_FLAGS, True))))
    except Exception as exc:  # a wrapper or config this torchao builds differently: not measurable
        raise UnsupportedLayerError(f"probing {wrapper.__name__} failed: {exc}") from exc
    computes = not torch.equal(out, linear(x, weight))
    if not computes:
        logger.warning(
            "quantwatch agent: torchao's %s does not route F.linear to its INT8 GEMMs in this torchao version: "
            "layers converted with module_swap=False train in high precision (module_swap=True works)",
            wrapper.__name__,
        )
    _PROBED[key] = computes
    return computes


def computes_int8(module: nn.Module) -> bool:
    """Whether the layer's INT8 GEMMs run at all (always for the module-swap class; for the weight wrapper, when
    this torchao routes ``F.linear`` to them); UnsupportedLayerError when it has no config with the GEMM flags."""
    config = int8_training_config(module)
    holder = _holder(module)
    return holder is module or _wrapper_computes_int8(type(holder), type(config), holder.device)


def int8_training_config(module: nn.Module) -> Any:
    """The layer's ``Int8MixedPrecisionTrainingConfig``; UnsupportedLayerError when it has none with the three
    GEMM flags."""
    config = getattr(_holder(module), "config", None)
    missing = [flag for flag in _FLAGS if not isinstance(getattr(config, flag, None), bool)]
    if missing:
        raise UnsupportedLayerError(f"its config ({type(config).__name__}) has no boolean {', '.join(missing)}")
    return config


def set_int8_gemms(module: nn.Module, on: bool) -> None:
    """Give the layer a config of its own with every GEMM flag ``on`` (the config object ``quantize_`` made is
    shared by every layer it converted, so it is replaced, never changed)."""
    config = int8_training_config(module)
    setattr(_holder(module), "config", dataclasses.replace(config, **dict.fromkeys(_FLAGS, on)))  # noqa: B010


def _int8_rowwise_cast(t: Tensor) -> CastResult:
    """torchao's cast of ``t`` flattened to rows (tokens, or the weight's output channels), one scale per row."""
    from torchao.prototype.quantized_training.int8 import quantize_int8_rowwise

    rows = t.reshape(-1, t.shape[-1])
    return _int8_result(rows, *quantize_int8_rowwise(rows))


def _int8_result(rows: Tensor, int8: Tensor, scale: Tensor) -> CastResult:
    """The cast ``(int8, scale)`` of the matrix ``rows`` as measured: dequantized row by row."""
    # scale = amax/127 puts every row within [-127, 127] before the clip to [-128, 127]: nothing is clipped.
    return CastResult(rows, int8.to(rows.dtype) * scale.view(-1, 1), None, scale.amax().float())


def _rows_of(rows: Tensor, t: Tensor | None) -> bool:
    """Whether ``rows`` is ``t`` viewed as a matrix of its last dimension (not its transpose, nor another tensor)."""
    if t is None or not rows.is_contiguous() or rows.data_ptr() != t.data_ptr() or not t.numel():
        return False
    return rows.shape == (t.numel() // t.shape[-1], t.shape[-1])


_CAPTURE = CastCapture(_MODULE, "quantize_int8_rowwise")
"""The casts ``_dynamic_int8_mm`` makes, while a sampled step's measurers listen
(:mod:`~quantwatch.agent.adapters.capture`)."""


class _CapturedInt8Linear(CapturedCastLinear):
    """Measures the casts an ``Int8MixedPrecisionTrainingLinear`` makes itself (`_CAPTURE`): the forward GEMM casts
    its input, then its weight; in the backward node the input-gradient GEMM's cast of the output gradient is the
    one of that gradient's own rows (the weight-gradient GEMM casts its transpose, and the input's).  A layer whose
    input needs no gradient makes no input-gradient GEMM: its gradient cast is recomputed, as is that of a backward
    node not of torchao's function (a newer torchao)."""

    capture = _CAPTURE

    def __init__(self, name: str, module: nn.Module, context: AdapterContext, casts: dict[int, Cast]) -> None:
        super().__init__(name, module, context, casts, unwrap=high_precision_data)
        self._calls = {True: 0, False: 0}  # casts seen in the running forward (True) and backward node (False)
        self._grad: Tensor | None = None  # the running backward node's output gradient, until its cast is measured

    def _weight_grad(self, x: Tensor, grad_output: Tensor) -> Tensor:
        """The reference weight gradient in the layout of the layer's: torchao computes an INT8 one as
        ``(Xᵀ dY)ᵀ``, a transposed view, so the update comparison reads both in place instead of copying one."""
        if not int8_training_config(self.module).grad_weight:
            return super()._weight_grad(x, grad_output)
        return super()._weight_grad(grad_output, x).mT  # (Xᵀ dY)ᵀ: the base's dYᵀX with the operands swapped

    def _backward_node(self, node: Any) -> Any | None:
        return node if "Int8MixedPrecisionTrainingLinearFunction" in node.name() else None

    def _entering(self, grad_outputs: tuple[Tensor | None, ...] | None) -> None:
        self._calls[grad_outputs is None] = 0
        if grad_outputs is not None:
            self._grad = grad_outputs[0]

    def _left_backward(self) -> None:
        grad, self._grad = self._grad, None
        grad_cast = self.casts.get(KIND_GRAD)
        if grad is not None and grad_cast is not None and KIND_GRAD in self.kinds:
            # No input gradient wanted (the first layer's): the cast its GEMM would have made, as recomputed.
            self._guard("cast_stats", self._measure_grad, grad_cast, grad)

    def _on_captured(self, forward: bool, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        index = self._calls[forward]
        self._calls[forward] = index + 1
        config = int8_training_config(self.module)
        if forward:
            kind = (KIND_INPUT, KIND_WEIGHT)[index] if config.output and index < 2 else None
        elif config.grad_input and _rows_of(args[0], self._grad):
            kind, self._grad = KIND_GRAD, None
        else:
            kind = None
        if kind is None or kind not in self.kinds:
            return
        if kind == KIND_WEIGHT:
            if self._weight_measured:
                return
            self._weight_measured = True
        with torch.no_grad():
            cast = _int8_result(args[0], *result)
            self.record(kind, cast.stats())
        if kind == KIND_INPUT:
            self._last_scale = cast.scale


class Int8MixedPrecisionTrainingAdapter(Adapter):
    """torchao INT8 mixed-precision training, both variants: an ``nn.Linear`` whose weight is an
    ``Int8MixedPrecisionTrainingLinearWeight`` and an ``Int8MixedPrecisionTrainingLinear`` (``module_swap``)."""

    name = "torchao.int8_mixed_precision"

    def recognises(self, module: nn.Module) -> bool:
        """A linear layer with the INT8 training weight, or of the module-swap class."""
        if isinstance(module, _module_classes()):
            return True
        return isinstance(module, nn.Linear) and isinstance(module.weight, _weight_classes())

    def formats(self, module: nn.Module) -> dict[str, str]:
        """Per kind, ``int8:channel`` (weight) / ``int8:token`` (input, grad) when its reported GEMM is INT8,
        ``high_precision`` when the config keeps it there; ``unknown`` for a config without the flags."""
        try:
            config = int8_training_config(module)
            if not computes_int8(module):
                return dict.fromkeys(_REPORTED, HIGH_PRECISION)
        except UnsupportedLayerError:
            return dict.fromkeys(_REPORTED, "unknown")
        return {kind: fmt if getattr(config, flag) else HIGH_PRECISION for kind, (flag, fmt) in _REPORTED.items()}

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy gets a config of its own with every GEMM in high precision."""
        set_int8_gemms(module, on=False)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer of the forward GEMM's weight and input casts and the input-gradient GEMM's output-gradient
        cast, those of them the config has in INT8: captured from a module-swap layer's own calls, else recomputed."""
        config = int8_training_config(module)
        on = computes_int8(module)
        casts: dict[int, Cast] = {
            _KINDS[kind]: _int8_rowwise_cast for kind, (flag, _) in _REPORTED.items() if on and getattr(config, flag)
        }
        if casts and _holder(module) is module and _CAPTURE.available():
            return _CapturedInt8Linear(name, module, context, casts)
        return RecomputedCastLinear(name, module, context, casts, unwrap=high_precision_data)
