"""torchao float8 training: ``torchao.float8.float8_linear.Float8Linear`` (``convert_to_float8_training``).

Each tensor can be cast twice, once per GEMM it enters (``Float8LinearConfig.cast_config_*`` and their
``*_for_grad_*`` variants; rowwise recipes scale the two along different axes).  Which cast each metric reports:

* ``weight_rel_l2``: the forward GEMM's weight cast (``cast_config_weight``), else the input-gradient GEMM's;
* ``act_rel_l2``, the ratios, ``amax``, ``scale``: the forward GEMM's input cast (``cast_config_input``), else the
  weight-gradient GEMM's (``cast_config_input_for_grad_weight``);
* ``grad_rel_l2``: the input-gradient GEMM's output-gradient cast (``cast_config_grad_output``), else the
  weight-gradient GEMM's;
* a tensor kept in high precision in both GEMMs has format ``high_precision`` and no figure.

The casts measured are the layer's own: while a step is sampled, ``hp_tensor_to_float8_dynamic`` as
``float8_linear`` calls it is wrapped, and each cast of a monitored layer (told apart by its ``linear_mm_config``,
one per layer) is handed to the layer's measurer with its high-precision input, so no cast is done twice.  Where
that wrapper cannot be installed (a torchao that calls its casts otherwise), the casts are recomputed with torchao's
own ``hp_tensor_to_float8_dynamic`` on the layer's ``config`` and ``linear_mm_config`` (dynamic scaling is
deterministic: the same values the layer computed with), and measured by the same native pass.  ``scale`` is
the dequantization scale ``1 / torchao's scale`` (largest over rows), as everywhere in QuantWatch.

An ``nn.Linear`` whose parameters ``Float8TrainingOpConfig`` (torchao's MoE-training API, or
``qw.actions.keep_high_precision(..., format="fp8")`` on an MXFP8 training layer) wrapped in a
``Float8TrainingWeightWrapperTensor`` runs the same GEMMs with the wrapper's ``Float8LinearConfig``: same formats,
its casts recomputed (and measured as above).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters.capture import CapturedCastLinear, CastCapture
from quantwatch.agent.adapters.linear import (
    Cast,
    CastResult,
    RecomputedCastLinear,
    high_precision_data,
    plain_linear_forward,
    runs_plain_linear,
    training_weight_classes,
)
from quantwatch.agent.adapters.registry import (
    FORMAT_KINDS,
    HIGH_PRECISION,
    Adapter,
    AdapterContext,
    UnsupportedLayerError,
    loaded_classes,
)
from quantwatch.agent.layers import KIND_GRAD, KIND_INPUT, KIND_NAMES, KIND_WEIGHT, LayerAdapter
from quantwatch.kernels import ErrorStats
from quantwatch.kernels.decode import float8_to_float32
from quantwatch.kernels.float8_stats import float8_cast_stats

__all__ = ["Float8LinearAdapter", "Float8TrainingWeightAdapter", "float8_format"]

_FLOAT8_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def _torchao_name(dtype: torch.dtype) -> str:
    return _FLOAT8_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def float8_format(cast_config: Any) -> str | None:
    """``"fp8_e4m3:tensor"`` / ``"fp8_e4m3:row"`` for a torchao ``CastConfig``; None when its scaling is disabled."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    if cast_config.scaling_type is ScalingType.DISABLED:
        return None
    granularity = "row" if cast_config.scaling_granularity is ScalingGranularity.AXISWISE else "tensor"
    return f"{_torchao_name(cast_config.target_dtype)}:{granularity}"


def _roles(config: Any) -> dict[int, list[tuple[Any, str, int]]]:
    """Per kind, the casts the layer does in the order they are reported: (cast config, role, axiswise dim) in
    torchao's own layout (weight as ``Wᵀ``, input as given, output gradient flattened to 2-D)."""
    return {
        KIND_WEIGHT: [
            (config.cast_config_weight, "WEIGHT", 0),
            (config.cast_config_weight_for_grad_input, "WEIGHT", -1),
        ],
        KIND_INPUT: [(config.cast_config_input, "INPUT", -1), (config.cast_config_input_for_grad_weight, "INPUT", 0)],
        KIND_GRAD: [
            (config.cast_config_grad_output, "GRAD_OUTPUT", -1),
            (config.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0),
        ],
    }


def _reported(config: Any) -> dict[int, tuple[Any, str, int] | None]:
    from torchao.float8.config import ScalingType

    chosen: dict[int, tuple[Any, str, int] | None] = {}
    for kind, casts in _roles(config).items():
        enabled = [c for c in casts if c[0].scaling_type is not ScalingType.DISABLED]
        chosen[kind] = enabled[0] if enabled else None
    return chosen


def _cast(config: Any, mm_config: Any, kind: int, cast_config: Any, role: str, axis: int) -> Cast:
    """One cast of a layer of ``Float8LinearConfig`` ``config`` and ``LinearMMConfig`` ``mm_config``."""
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    gemm_role = GemmInputRole[role]
    dtype = cast_config.target_dtype
    fmax = torch.finfo(dtype).max
    axiswise_dim = get_maybe_axiswise_dim(axis, cast_config.scaling_granularity)

    def cast(t: Tensor) -> CastResult:
        if kind == KIND_WEIGHT:
            t = t.t()  # torchao casts Wᵀ
        elif kind == KIND_GRAD or axis == 0:
            t = t.reshape(-1, t.shape[-1])  # torchao flattens these to 2-D before casting
        fp8 = hp_tensor_to_float8_dynamic(
            t,
            dtype,
            mm_config,
            gemm_input_role=gemm_role,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=axiswise_dim,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
        return _RecomputedCast(t, fp8, fmax)

    return cast


class _RecomputedCast(CastResult):
    """A recomputed cast (`_cast`): its statistics and scale from `_cast_stats` (one native pass over its bytes where
    the pass takes the cast, bit for bit `_cast_result`'s figures); `_cast_result`'s tensors (the input as measured,
    the dequantized cast, the mask) are made only if read."""

    _measured: ErrorStats
    _inputs: tuple[Tensor, Any, float]

    def __init__(self, hp: Tensor, fp8: Any, fmax: float) -> None:  # the tensor fields are read lazily
        measured, scale = _cast_stats(hp, fp8, fmax, with_scale=True)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "_measured", measured)
        object.__setattr__(self, "_inputs", (hp, fp8, fmax))

    @functools.cached_property
    def _tensors(self) -> CastResult:
        return _cast_result(*self._inputs, with_scale=False)

    @property
    def hp(self) -> Tensor:
        """The high-precision tensor as measured (W for the weight's ``Wᵀ``)."""
        return self._tensors.hp

    @property
    def dequantized(self) -> Tensor:
        """The dequantized cast, in ``hp``'s layout."""
        return self._tensors.dequantized

    @property
    def overflow(self) -> Tensor | None:
        """The clipped elements (None: none was)."""
        return self._tensors.overflow

    def stats(self) -> ErrorStats:
        """The cast's error statistics, as ``stats_from_masks(hp, dequantized, overflow)`` gives them."""
        return self._measured


def _cast_result(hp: Tensor, fp8: Any, fmax: float, with_scale: bool = True) -> CastResult:
    """The figures' inputs of one torchao cast: ``fp8`` (a ``Float8TrainingTensor``) of the high-precision ``hp``;
    its dequantization scale only ``with_scale`` (``scale`` reports the input's)."""
    scale = fp8._scale
    # to_original_precision() (`_data.to(orig_dtype) / scale`) without its autograd Function, decoded natively
    dequantized: Tensor | None = None
    if fp8._orig_dtype == torch.float32:
        # A tensorwise scale divides the table of the 256 codes instead: the same float32 divisions, in one pass.
        dequantized = float8_to_float32(fp8._data, scale) if scale.numel() == 1 else None
        if dequantized is None and (decoded := float8_to_float32(fp8._data)) is not None:
            dequantized = decoded.div_(scale)
    if dequantized is None:
        dequantized = fp8._data.to(fp8._orig_dtype) / scale
    clip_scale = scale
    if _transposed(hp):
        # Wᵀ as torchao casts it: the same statistics over W, in the layout the native statistics pass reads.
        hp, dequantized = hp.t(), dequantized.t()
        clip_scale = scale.t() if scale.dim() == 2 else scale
    overflow = _overflow_mask(hp.to(torch.float32), clip_scale, fmax)
    return CastResult(hp, dequantized, overflow, _reported_scale(scale) if with_scale else None)


def _transposed(hp: Tensor) -> bool:
    """Whether ``hp`` is a transposed contiguous matrix (``Wᵀ``, as torchao casts the weight)."""
    return hp.dim() == 2 and not hp.is_contiguous() and hp.t().is_contiguous()


def _reported_scale(scale: Tensor) -> Tensor:
    """The dequantization scale reported of torchao's ``scale``: ``1 / scale``, largest over rows (a tensorwise
    scale's reciprocal itself: torch's ``1.0 / t`` is ``t.reciprocal() * 1.0``, and the 0-dim amax a copy)."""
    inverse = (scale if scale.dtype == torch.float32 else scale.to(torch.float32)).reciprocal()
    return inverse if inverse.dim() == 0 else inverse.amax()


def _cast_stats(hp: Tensor, fp8: Any, fmax: float, with_scale: bool) -> tuple[ErrorStats, Tensor | None]:
    """``_cast_result(...).stats()`` and its scale; where the native kernels take the cast (a float32 input, a
    tensorwise or rowwise scale: `float8_cast_stats`), from one pass over its bytes and ``hp``, the same figures bit
    for bit without the dequantized tensor or the mask.  ``hp`` may require grad: the pass reads its memory and
    records nothing; the tensors' way runs without grad on it detached."""
    codes, scale = fp8._data, fp8._scale
    stats = None
    if fp8._orig_dtype == torch.float32:
        if _transposed(hp):  # over W, as _cast_result reads Wᵀ (views without autograd: only the memory is read)
            x = hp.detach().t()
            stats = float8_cast_stats(x, codes.t(), scale.t() if scale.dim() == 2 else scale, fmax)
        else:
            stats = float8_cast_stats(hp, codes, scale, fmax)
    if stats is None:
        with torch.no_grad():
            result = _cast_result(hp.detach(), fp8, fmax, with_scale)
            return result.stats(), result.scale
    if not with_scale:
        return stats, None
    return stats, _reported_scale(scale.detach())


def _overflow_mask(hp: Tensor, scale: Tensor, fmax: float) -> Tensor | None:
    """Which elements the saturated cast clipped, ``|hp · scale| > fmax``; None when none was.

    Under one scale for the whole tensor (tensorwise) on the CPU, the largest ``|hp|`` tells first whether any was:
    rounding is monotonic, so ``fl(max|h| · s) > fmax`` exactly when some ``fl(|h| · s) > fmax``, and two reductions
    replace three passes and a mask in most casts (in about one of ten, the largest value's product rounds past
    ``fmax``).  The statistics count no overflow for None as for a mask of no element (a non-finite ``hp`` fails the
    test, and the mask is built).  Rowwise scales take the mask: with a scale per row, some row's largest value
    nearly always rounds past, and reductions along rows cost more than the mask."""
    if hp.device.type == "cpu" and hp.numel() and scale.numel() == 1:
        largest = torch.maximum(hp.amax(), hp.amin().neg_())
        if bool(largest * scale.reshape(()) <= fmax):
            return None
    return (hp * scale).abs_() > fmax


_CAPTURE = CastCapture("torchao.float8.float8_linear", "hp_tensor_to_float8_dynamic")
"""``float8_linear``'s casts, while a sampled step's measurers listen (:mod:`~quantwatch.agent.adapters.capture`)."""


def _autocast_input(x: Tensor) -> Tensor:
    # Float8Linear.forward casts its input to the (CUDA) autocast dtype before anything else.
    if torch.is_autocast_enabled():
        return x.to(torch.get_autocast_dtype("cuda"))
    return x


class Float8LinearAdapter(Adapter):
    """``Float8Linear`` of torchao float8 training (tensorwise, rowwise, rowwise_with_gw_hp; emulated or not)."""

    name = "torchao.float8"

    def recognises(self, module: nn.Module) -> bool:
        """An instance of ``Float8Linear`` (only when torchao's float8 module is loaded: nothing else makes one)."""
        return isinstance(module, loaded_classes("torchao.float8.float8_linear:Float8Linear"))

    def formats(self, module: nn.Module) -> dict[str, str]:
        """The reported cast's format per kind (see the module doc)."""
        return _formats(module.config)

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy runs ``F.linear`` on the high-precision weight."""
        plain_linear_forward(module)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer recomputing the layer's casts with torchao's ``hp_tensor_to_float8_dynamic``."""
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "linear_mm_config"):
            raise UnsupportedLayerError("no config / linear_mm_config attribute (a newer torchao renamed them?)")
        if getattr(config, "enable_fsdp_float8_all_gather", False):
            raise UnsupportedLayerError("enable_fsdp_float8_all_gather (the weight is cast before the layer sees it)")
        casts = _casts(config, getattr(module, "linear_mm_config"))  # noqa: B009 (torchao's attribute, untyped)
        if not _CAPTURE.available():
            return RecomputedCastLinear(name, module, context, casts, prepare_input=_autocast_input)
        return _CapturedCastLinear(name, module, context, casts, config)


def _formats(config: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind, chosen in _reported(config).items():
        fmt = float8_format(chosen[0]) if chosen is not None else None
        out[KIND_NAMES[kind]] = fmt or HIGH_PRECISION
    return out


def _casts(config: Any, mm_config: Any) -> dict[int, Cast]:
    """The reported cast of each kind not kept in high precision."""
    return {kind: _cast(config, mm_config, kind, *chosen) for kind, chosen in _reported(config).items() if chosen}


class Float8TrainingWeightAdapter(Adapter):
    """``nn.Linear`` whose parameters torchao's ``Float8TrainingOpConfig`` wrapped in a
    ``Float8TrainingWeightWrapperTensor`` (its linear runs ``Float8Linear``'s GEMMs with the recipe's
    ``Float8LinearConfig``); the casts are recomputed, as for a ``Float8Linear`` whose casts cannot be captured."""

    name = "torchao.float8_training_weight"

    def recognises(self, module: nn.Module) -> bool:
        """A linear layer whose weight is float8 training's wrapper tensor."""
        wrapper = training_weight_classes("Float8TrainingWeightWrapperTensor")
        return isinstance(module, nn.Linear) and isinstance(module.weight, wrapper)

    def formats(self, module: nn.Module) -> dict[str, str]:
        """The reported cast's format per kind, from the wrapper's recipe; high precision once kept there."""
        if runs_plain_linear(module):
            return dict.fromkeys(FORMAT_KINDS, HIGH_PRECISION)
        return _formats(getattr(module.weight, "config")._float8_linear_config)  # noqa: B009

    def dequantize(self, module: nn.Module) -> None:
        """The shadow copy runs ``F.linear`` on the wrapped data."""
        plain_linear_forward(module)

    def create(self, name: str, module: nn.Module, context: AdapterContext) -> LayerAdapter:
        """A measurer recomputing the layer's casts (none once kept in high precision)."""
        config = getattr(module.weight, "config", None)
        linear_config = getattr(config, "_float8_linear_config", None)
        mm_config = getattr(config, "_linear_mm_config", None)
        if linear_config is None or mm_config is None:
            raise UnsupportedLayerError("the weight wrapper's config has no _float8_linear_config / _linear_mm_config")
        casts = {} if runs_plain_linear(module) else _casts(linear_config, mm_config)
        return RecomputedCastLinear(name, module, context, casts, unwrap=high_precision_data)


# Per autograd node class (one per op or autograd Function), whether it is float8_linear's matmul.
_MATMUL_NODES: dict[type, bool] = {}


def _is_float8_matmul(node: Any) -> bool:
    if node is None:
        return False
    known = _MATMUL_NODES.get(type(node))
    if known is None:
        known = _MATMUL_NODES[type(node)] = "matmul_with_hp_or_float8_args" in node.name()
    return known


class _CapturedCastLinear(CapturedCastLinear):
    """Measures the casts a ``Float8Linear`` makes itself (`_CAPTURE`); the reported cast of each kind (see the
    module doc) is told apart by its ``GemmInputRole`` and whether it is the forward GEMM's.  A layer whose matmul
    backward node cannot be found (a newer torchao) gets its gradient cast recomputed instead."""

    capture = _CAPTURE

    def __init__(
        self, name: str, module: nn.Module, context: AdapterContext, casts: dict[int, Cast], config: Any
    ) -> None:
        super().__init__(name, module, context, casts, prepare_input=_autocast_input)
        reported = _reported(config)
        from torchao.float8.float8_training_tensor import GemmInputRole

        # Per role: (kind, whether the reported cast is the forward GEMM's, the format's largest value).
        self._wanted: dict[Any, tuple[int, bool, float]] = {}
        for kind, chosen in reported.items():
            if chosen is not None:
                cast_config, role, axis = chosen
                forward = (role, axis) in (("WEIGHT", 0), ("INPUT", -1))
                self._wanted[GemmInputRole[role]] = (kind, forward, torch.finfo(cast_config.target_dtype).max)
        # The gradient of the last gradient cast measured: the weight-gradient GEMM casts the same tensor again (a
        # weak reference: a later backward's gradient is another tensor, so it needs no reset between steps).
        self._last_grad: weakref.ref[Tensor] | None = None

    def _backward_node(self, node: Any) -> Any | None:
        if not _is_float8_matmul(node):  # `output + bias`: the matmul is the addition's first input
            node = next((n for n, _ in node.next_functions if _is_float8_matmul(n)), None)
        return node

    def _on_captured(self, forward: bool, args: tuple[Any, ...], kwargs: dict[str, Any], fp8: Any) -> None:
        self._on_cast(args[0], fp8, kwargs.get("gemm_input_role"), forward)

    def _on_cast(self, hp: Tensor, fp8: Any, role: Any, forward: bool) -> None:
        wanted = self._wanted.get(role)
        if wanted is None:
            return
        kind, in_forward, fmax = wanted
        if kind not in self.kinds or forward != in_forward:
            return
        if kind == KIND_WEIGHT:
            if self._weight_measured:
                return
            self._weight_measured = True
        elif kind == KIND_GRAD:
            last = self._last_grad
            if last is not None and last() is hp:
                return
            self._last_grad = weakref.ref(hp)
        stats, scale = _cast_stats(hp, fp8, fmax, with_scale=kind == KIND_INPUT)
        self.record(kind, stats)
        if kind == KIND_INPUT:
            self._last_scale = scale
