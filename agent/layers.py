"""Adapters between monitored things (layers and kernels) and the per-step statistics the monitor collects.

Each adapter is idle until :meth:`arm` is called for a sampled step with the set of measurement *kinds* that step
needs; :meth:`disarm` removes every hook and observer again, so an unsampled step runs the model exactly as without
the agent.  What an adapter records are :class:`~quantwatch.kernels.ErrorStats` (mergeable partial sums, tensors on
the layer's device), combined over every call within the step when the step is taken.  The quantization statistics
of CPU tensors are deferred to the monitor's :class:`DeferredStatistics` and computed together (see there).

Three kinds of modules are recognised:

* the **reference-forward protocol** (``QuantLinear`` and everything ``quantize_model`` produced implement it): a
  module with a method ``reference_forward(input) -> Tensor`` that computes the FP32 shadow output (same weights, no
  quantization).  Optionally an ``observer`` attribute: when set, the module calls ``observer(kind, stats)`` with
  ``kind`` in ``"weight" | "input" | "grad"`` after each quantization it does.  Optionally a ``weight`` parameter
  (needed for ``update_cosine`` and ``weight_drift_rel_l2``) and an ``input_quantizer.last_scale`` tensor (``scale``).
  Optionally ``reference_weight_grad(input, grad_output) -> Tensor``, the FP32 reference's weight gradient computed
  directly; without it that gradient comes from autograd through the graph of ``reference_forward``.
* **PyTorch QAT modules** (``torch.ao``) that carry ``weight_fake_quant`` and/or ``activation_post_process`` fake
  quantizers: their FP32 reference is the same ``forward`` with every fake quantizer and observer inside the module
  switched off (and restored, observers untouched).
* **kernels** wrapped with :meth:`Monitor.watch_kernel`: ``q = fn(x, ...)``, error of ``q`` against ``x``.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from quantwatch.agent.comparison import comparison_stats, row_comparison_stats
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.rows import SEED, RowSampler
from quantwatch.agent.shadow import ShadowOptions, run_reference
from quantwatch.agent.wrappers import shards_after_forward
from quantwatch.kernels import ErrorStats, QuantLinear, StatsBatch
from quantwatch.kernels.row_stats import (
    RowsPass,
    compare_linear_rows,
    compare_weight_grad_rows,
    scratch_matrix,
    weight_grad_rows,
)
from quantwatch.kernels.stats import host_row

__all__ = [
    "KIND_DRIFT",
    "KIND_GRAD",
    "KIND_INPUT",
    "KIND_NAMES",
    "KIND_OUTPUT",
    "KIND_UPDATE",
    "KIND_WEIGHT",
    "DeferredStatistics",
    "LayerAdapter",
    "ModuleAdapter",
]

KIND_WEIGHT, KIND_INPUT, KIND_GRAD, KIND_OUTPUT, KIND_UPDATE, KIND_DRIFT = range(6)
KIND_NAMES = ("weight", "input", "grad", "output", "update", "drift")
_OBSERVER_KINDS = {"weight": KIND_WEIGHT, "input": KIND_INPUT, "grad": KIND_GRAD}

F = TypeVar("F", bound=Callable[..., Any])


class OverheadClock:
    """Adds up the seconds the agent spends on the training thread.

    ``with clock.measure():`` times a block; the clock is its own context manager (a generator-based one costs
    several microseconds per block on a sampled step, about a hundred blocks per step)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._started = 0.0

    def measure(self) -> OverheadClock:
        """Time the enclosed block (a block inside another counts once, with the outer one)."""
        return self

    def __enter__(self) -> None:
        if not self._depth:
            self._started = time.perf_counter()
        self._depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if not self._depth:
            self.seconds += time.perf_counter() - self._started


class DeferredStatistics:
    """The monitor's `StatsBatch` for the quantization statistics of a sampled step, and when it is flushed.

    Computed together, the statistics of a step's CPU quantizations cost about half what the same calls cost spread
    over the step.  The batch is flushed before anything is expected to change the tensors it holds: when the
    monitored model's forward returns, at the first gradient statistics of a backward that follows forward
    statistics, before any optimizer step (a global pre-hook while a step is sampled: the weights and gradients
    before they move, also those of a forward recomputed inside backward for activation checkpointing), and at
    ``monitor.step``.  A tensor changed in place all the same leaves its statistics unfilled: they are reported as
    not measured, and the failure is counted."""

    def __init__(self, failures: FailureLog, clock: OverheadClock) -> None:
        self.batch = StatsBatch()
        self.failures = failures
        self.clock = clock
        self.forward_pending = False

    def flush(self) -> None:
        """Compute every pending statistic (on the training thread: the agent's time, so it is measured)."""
        self.forward_pending = False
        with self.clock.measure():
            try:
                result = self.batch.flush()
            except Exception as exc:
                self.failures.record("statistics_failed", f"deferred statistics: {exc}", exc)
                return
        if result.stale:
            self.failures.record(
                "statistics_stale", f"{result.stale} tensors changed in place before their statistics; not reported"
            )
        if result.failed:
            self.failures.record(
                "statistics_failed", f"{result.failed} deferred statistics failed: {result.error}", result.error
            )

    def on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: flush before the weights (and the gradients it may scale) change in place, also
        when no forward hook fired since the last statistics (a forward recomputed inside backward for activation
        checkpointing)."""
        if len(self.batch):
            self.flush()

    def on_model_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of the monitored model: flush what its forward collected."""
        self.flush()


def _first_tensor(args: tuple[Any, ...]) -> Tensor | None:
    return args[0] if args and isinstance(args[0], Tensor) else None


def _token_rows(module: nn.Module, x: Tensor, output: Tensor) -> tuple[Tensor, Tensor] | None:
    """An ``nn.Linear`` call's input and output as ``(tokens, features)`` matrices; None for any other shape."""
    if not isinstance(module, nn.Linear) or x.dim() < 2 or x.shape[:-1] != output.shape[:-1]:
        return None
    if x.shape[-1] != module.in_features or output.shape[-1] != module.out_features:
        return None
    return x.reshape(-1, x.shape[-1]), output.detach().reshape(-1, output.shape[-1])


def _weight_grad(grad_output: Tensor, x: Tensor) -> Tensor:
    return grad_output.T.mm(x)


class LayerAdapter:
    """Per-step statistics of one monitored thing, and the hooks that fill them on sampled steps."""

    def __init__(self, name: str, failures: FailureLog, clock: OverheadClock) -> None:
        self.name = name
        self.failures = failures
        self.clock = clock
        self.stats: list[list[ErrorStats]] = [[] for _ in KIND_NAMES]
        self.kinds: frozenset[int] = frozenset()
        self.estimated: set[int] = set()  # kinds of this step some of whose statistics were estimated (shadow_rows)

    @property
    def weight(self) -> Tensor | None:
        """The layer's weight parameter, when it has one."""
        return None

    def scale(self) -> Tensor | None:
        """The most recent scale of the activation quantizer, as a 0-dim tensor of a floating dtype (largest value
        when per block)."""
        return None

    def record(self, kind: int, stats: ErrorStats) -> None:
        """Add ``stats`` to this step's statistics of ``kind`` (combined in `take`: deferred ones are filled later)."""
        self.stats[kind].append(stats)

    def take(self) -> list[ErrorStats | None]:
        """This step's statistics by kind (None where none were recorded), cleared for the next sampled step."""
        taken, self.stats = self.stats, [[] for _ in KIND_NAMES]
        return [functools.reduce(ErrorStats.combine, parts) if parts else None for parts in taken]

    def take_estimated(self) -> set[int]:
        """The kinds this step estimated from a subset of rows, cleared for the next sampled step."""
        taken, self.estimated = self.estimated, set()
        return taken

    def configure(self, options: ShadowOptions, index: int) -> None:
        """Take the monitor's reference options; ``index`` is the adapter's position in ``monitor.layers``."""

    def arm(self, kinds: frozenset[int]) -> None:
        """Install what measuring ``kinds`` needs for the coming step."""
        self.kinds = kinds

    def end_step(self) -> None:
        """Forget what belongs only to the step that ends; the hooks stay for the next sampled step."""

    def disarm(self) -> None:
        """Remove every hook and observer."""
        self.end_step()
        self.kinds = frozenset()

    def _guard(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        with self.clock:
            try:
                fn(*args)
            except Exception as exc:
                self.failures.record(f"{what}_failed", f"{self.name}: {exc}", exc)


class _ShadowedModuleAdapter(LayerAdapter):
    """Common part of module adapters: output deviation and update direction against the FP32 reference."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        failures: FailureLog,
        clock: OverheadClock,
        deferred: DeferredStatistics | None = None,
    ) -> None:
        super().__init__(name, failures, clock)
        self.module = module
        self.deferred = deferred
        self._handles: list[RemovableHandle] = []
        self._hooked_weight: Tensor | None = None
        # (reference weight gradient or what computes it, rows of it that were computed or None for all)
        self._pending_reference_grads: deque[
            tuple[Tensor | Callable[[], Tensor] | _KeptRowsGradient | None, Tensor | None]
        ] = deque()
        self._in_reference = False
        self._computing_reference_grad = False
        self.options = ShadowOptions()
        self.rows: RowSampler | None = None
        self._bind()

    def _bind(self) -> None:
        """Read what a subclass needs of its module, once, at the end of construction."""

    @property
    def weight(self) -> Tensor | None:
        """The module's ``weight`` parameter, if it has one."""
        w = getattr(self.module, "weight", None)
        return w if isinstance(w, Tensor) else None

    def _batch(self) -> StatsBatch | None:
        return self.deferred.batch if self.deferred is not None else None

    def reference(self, x: Tensor) -> Tensor:
        """The FP32 reference output for input ``x``."""
        raise TypeError(f"{type(self).__name__} has no reference")

    def reference_weight_grad(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """``(input, grad_output) -> weight gradient`` of the FP32 reference, or None to use autograd."""
        return None

    def reference_linear(self) -> tuple[Tensor, Tensor | None] | None:
        """``(weight, bias)`` when the reference is ``F.linear(x, weight, bias)`` of float32 tensors computed in
        float32 (``shadow_rows`` then computes the kept rows' reference and compares it in one native pass), else
        None."""
        return None

    def configure(self, options: ShadowOptions, index: int) -> None:
        """Reference precision for every comparison; a row sampler for ``nn.Linear`` layers (quantwatch.agent.rows)."""
        self.options = options
        linear = isinstance(self.module, nn.Linear)
        self.rows = RowSampler(options.rows, SEED + index) if options.rows is not None and linear else None

    def _run_reference(self, x: Tensor) -> Tensor:
        self._in_reference = True
        try:
            return run_reference(self.reference, x, dtype=self.options.reference_dtype)
        finally:
            self._in_reference = False

    def arm(self, kinds: frozenset[int]) -> None:
        """Hook the module's forward when the output or update kinds are needed."""
        super().arm(kinds)
        if KIND_OUTPUT in kinds or KIND_UPDATE in kinds:
            # Under FSDP2 (fully_shard on this very module) first among its forward hooks: FSDP's post-forward hook
            # reshards the weight to a DTensor shard; before it, `module.weight` is still the unsharded weight the
            # forward used, which the reference then uses too (and whose local gradient the update comparison
            # hooks, before the reduce-scatter).  Otherwise last, after hooks that are part of the layer's output
            # (eager QAT's activation fake quantization is a forward hook).
            prepend = shards_after_forward(self.module)
            self._handles.append(self.module.register_forward_hook(self._on_forward, prepend=prepend))

    def end_step(self) -> None:
        """Forget half-finished gradient pairs; the row draws of the step are used no more."""
        self._pending_reference_grads.clear()
        if self.rows is not None:
            self.rows.release()

    def disarm(self) -> None:
        """Remove the hooks and forget half-finished gradient pairs."""
        super().disarm()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked_weight = None

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._in_reference:
            return
        x = _first_tensor(args)
        if x is None or not isinstance(output, Tensor):
            return
        self._guard("reference_forward", self._compare, x, output)

    def _compare(self, x: Tensor, output: Tensor) -> None:
        weight = self.weight
        node = output.grad_fn  # None: no graph from the weight to this output, so no update to compare
        want_update = KIND_UPDATE in self.kinds and node is not None and weight is not None and weight.requires_grad
        # update_cosine: the quantized path's weight gradient (seen by a hook on the weight) against the FP32
        # reference gradient of the same layer and batch, from the output gradient of the quantized path and either
        # the module's direct formula or the reference graph built here (a local backward through this layer only).
        # The output gradient comes from a pre-hook on the output's autograd node, registered once per layer and
        # forward: a tensor hook costs ~25 % more to register in a sampled step (2.5 times in a loop).
        x = x.detach()
        tokens = _token_rows(self.module, x, output) if self.rows is not None else None
        if tokens is not None and self.rows is not None:
            self._compare_rows(self.rows, *tokens, node if want_update else None, weight)
            return
        direct_grad = self.reference_weight_grad() if want_update else None
        through_graph = want_update and direct_grad is None
        if KIND_OUTPUT in self.kinds or through_graph:
            with torch.set_grad_enabled(through_graph):
                reference = self._run_reference(x)
            if KIND_OUTPUT in self.kinds:
                self.record(KIND_OUTPUT, comparison_stats(reference, output, batch=self._batch()))
            if through_graph and node is not None and weight is not None:
                node.register_prehook(functools.partial(self._on_output_grad, reference, weight, output.output_nr))
        if direct_grad is not None and node is not None:
            node.register_prehook(functools.partial(self._on_output_grad_direct, direct_grad, x, output.output_nr))
        if want_update and weight is not None:
            self._hook_weight(weight)

    def _hook_weight(self, weight: Tensor) -> None:
        if weight is not self._hooked_weight:
            # One hook serves every forward until disarmed: it pairs each weight gradient with the oldest pending
            # reference gradient.
            self._handles.append(weight.register_hook(self._on_weight_grad))  # type: ignore[no-untyped-call]
            self._hooked_weight = weight

    def _compare_rows(self, sampler: RowSampler, x: Tensor, output: Tensor, node: Any, weight: Tensor | None) -> None:
        """``shadow_rows``: the comparisons of an ``nn.Linear`` call on kept rows (see quantwatch.agent.rows)."""
        n = x.shape[0]
        want_output = KIND_OUTPUT in self.kinds
        grad_weight = weight if node is not None else None  # whose gradient's rows are compared
        device = x.device
        out_features, grad_device = (
            (None, device) if grad_weight is None else (grad_weight.shape[0], grad_weight.device)
        )
        rows, grad_rows = sampler.draw_layer(n, want_output, out_features, device, grad_device)
        if want_output:
            if rows is None:
                stats = comparison_stats(self._run_reference(x), output, batch=self._batch())
            else:
                stats = self._output_rows_stats(x, output, rows, n / rows.numel())
                self.estimated.add(KIND_OUTPUT)
            self.record(KIND_OUTPUT, stats)
        if grad_weight is not None:
            node.register_prehook(functools.partial(self._on_output_grad_rows, x, grad_rows, output.output_nr))
            self._hook_weight(grad_weight)

    def _output_rows_stats(self, x: Tensor, output: Tensor, rows: Tensor, weight: float) -> ErrorStats:
        """The output comparison on the kept ``rows``: in one native pass where the reference is a float32 linear
        it can compute, else the reference of the gathered rows compared with those rows of ``output``."""
        linear = self.reference_linear() if x.is_cpu else None
        if linear is not None:
            row = host_row(self._batch())
            if compare_linear_rows(x, *linear, rows, output, row, weight=weight):
                return row.stats
        reference = self._run_reference(x.index_select(0, rows))
        return row_comparison_stats(reference, output, rows, batch=self._batch(), weight=weight)

    def _on_output_grad_rows(
        self, x: Tensor, grad_rows: Tensor | None, index: int, grad_outputs: tuple[Tensor | None, ...]
    ) -> None:
        grad_output = grad_outputs[index]
        if grad_output is not None:
            self._guard("reference_grad", self._keep_grad_rows, x, grad_rows, grad_output)

    def _keep_grad_rows(self, x: Tensor, grad_rows: Tensor | None, grad_output: Tensor) -> None:
        # Compared at the weight hook, reference and comparison in one pass (`_compare_update`).
        dy = grad_output.detach().reshape(-1, grad_output.shape[-1])
        self._pending_reference_grads.append((_KeptRowsGradient(dy, x), grad_rows))

    def _reference_grad_rows(self, x: Tensor, grad_rows: Tensor | None, dy: Tensor) -> Tensor:
        # nn.Linear's weight gradient dYᵀX, for the kept rows J of it: dY[:, J]ᵀ X, in FP32 one native pass reading
        # dY's columns in place where it can (float32 tensors: what run_reference would compute in FP32).
        reference_grad = None
        if grad_rows is not None and self.options.reference_dtype == torch.float32:
            reference_grad = weight_grad_rows(dy, x, grad_rows)
        if reference_grad is None:
            if grad_rows is not None:
                dy = dy.index_select(1, grad_rows)
            reference_grad = run_reference(_weight_grad, dy, x, dtype=self.options.reference_dtype)
        return reference_grad

    def _on_output_grad(
        self, reference: Tensor, weight: Tensor, index: int, grad_outputs: tuple[Tensor | None, ...]
    ) -> None:
        grad_output = grad_outputs[index]
        if grad_output is not None:
            self._guard("reference_grad", self._reference_grad_through_graph, reference, weight, grad_output)

    def _reference_grad_through_graph(self, reference: Tensor, weight: Tensor, grad_output: Tensor) -> None:
        self._computing_reference_grad = True
        try:
            (reference_grad,) = torch.autograd.grad(reference, weight, grad_output.detach(), allow_unused=True)
        finally:
            self._computing_reference_grad = False
        self._pending_reference_grads.append((reference_grad, None))

    def _on_output_grad_direct(
        self,
        direct_grad: Callable[[Tensor, Tensor], Tensor],
        x: Tensor,
        index: int,
        grad_outputs: tuple[Tensor | None, ...],
    ) -> None:
        grad_output = grad_outputs[index]
        if grad_output is not None:
            self._guard("reference_grad", self._reference_grad_direct, direct_grad, x, grad_output)

    def _reference_grad_direct(
        self, direct_grad: Callable[[Tensor, Tensor], Tensor], x: Tensor, grad_output: Tensor
    ) -> None:
        # Computed when the quantized path's gradient is there (`_compare_update`), not here: compared right after
        # the matmul wrote it, the reference is still in the caches (a weight's size, it is not by then).
        dtype = self.options.reference_dtype
        self._pending_reference_grads.append(
            (functools.partial(run_reference, direct_grad, x, grad_output.detach(), dtype=dtype), None)
        )

    def _on_weight_grad(self, grad: Tensor) -> None:
        if self._computing_reference_grad or not self._pending_reference_grads:
            # The hook also sees the reference gradient being computed (only the quantized path's counts), and the
            # gradients of forwards that wanted no update comparison.
            return
        self._guard("update_compare", self._compare_update, grad)

    def _compare_update(self, grad: Tensor) -> None:
        reference_grad, rows = self._pending_reference_grads.popleft()
        if isinstance(reference_grad, _KeptRowsGradient):
            if self._compare_kept_rows_update(reference_grad, rows, grad):
                return
            reference_grad = self._reference_grad_rows(reference_grad.x, rows, reference_grad.dy)
        elif callable(reference_grad):
            reference_grad = reference_grad()
        if reference_grad is None:
            return
        # Σ(g_q − g_ref)² taken directly for update_rel_l2: rebuilt from Σq² − 2Σqx + Σx² it cancels catastrophically
        # at FP8-sized errors.
        if rows is None:
            stats = comparison_stats(reference_grad, grad, batch=self._batch())
        else:
            weight = grad.shape[0] / rows.numel()
            stats = row_comparison_stats(reference_grad, grad, rows, batch=self._batch(), weight=weight)
            self.estimated.add(KIND_UPDATE)
        self.record(KIND_UPDATE, stats)

    def _compare_kept_rows_update(self, kept: _KeptRowsGradient, rows: Tensor | None, grad: Tensor) -> bool:
        """The reference gradient of the kept ``rows`` and its comparison in one native pass, recorded: True when
        done. Where the pass declines on the values (NaN/±inf) the reference rows it computed are compared another
        way, not computed again."""
        if rows is None or self.options.reference_dtype != torch.float32 or not grad.is_cpu:
            return False
        batch, weight = self._batch(), grad.shape[0] / rows.numel()
        row, reference = host_row(batch), scratch_matrix(rows.shape[0], kept.x.shape[1])
        ended = compare_weight_grad_rows(kept.dy, kept.x, rows, grad, row, weight=weight, reference=reference)
        if ended is RowsPass.REFERENCE:
            stats = row_comparison_stats(reference, grad, rows, batch=batch, weight=weight)
        elif ended is RowsPass.COMPARED:
            stats = row.stats
        else:
            return False
        self.estimated.add(KIND_UPDATE)
        self.record(KIND_UPDATE, stats)
        return True


class _KeptRowsGradient(NamedTuple):
    """What the kept rows' reference weight gradient is computed from at the weight hook (``shadow_rows``): the
    output gradient as a matrix and the input's (the kept rows of the gradient are queued beside it)."""

    dy: Tensor
    x: Tensor


class ModuleAdapter(_ShadowedModuleAdapter):
    """A module that implements the reference-forward protocol (``QuantLinear`` and friends).

    A module with a ``stats_batch`` attribute (``QuantLinear``) gets ``deferred.batch`` on sampled steps."""

    def _bind(self) -> None:
        self._batches = self.deferred is not None and hasattr(self.module, "stats_batch")
        # QuantLinear's reference, not a subclass's own (QuantConv1D's weight is a transposed view: declined anyway)
        forward = getattr(type(self.module), "reference_forward", None)
        self._plain_reference = isinstance(self.module, QuantLinear) and forward is QuantLinear.reference_forward

    def reference(self, x: Tensor) -> Tensor:
        """``module.reference_forward(x)``."""
        out = self.module.reference_forward(x)  # type: ignore[operator]
        if not isinstance(out, Tensor):
            raise TypeError(f"reference_forward must return a Tensor, got {type(out).__name__}")
        return out

    def reference_weight_grad(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """``module.reference_weight_grad`` when the module has it."""
        method = getattr(self.module, "reference_weight_grad", None)
        return method if callable(method) else None

    def reference_linear(self) -> tuple[Tensor, Tensor | None] | None:
        """A ``QuantLinear``'s own weight and bias (its `reference_forward` is ``F.linear`` of them) in float32."""
        if not self._plain_reference or self.options.reference_dtype != torch.float32:
            return None
        module = self.module
        weight, bias = module.linear_weight(), module.bias  # type: ignore[operator]
        return weight, bias if isinstance(bias, Tensor) else None

    def scale(self) -> Tensor | None:
        """``module.input_quantizer.last_scale`` reduced to its largest value."""
        quantizer = getattr(self.module, "input_quantizer", None)
        last = getattr(quantizer, "last_scale", None)
        if not isinstance(last, Tensor):
            return None
        if last.ndim == 0:  # the common per-tensor scale, as it is (few torch calls: each costs more than the work)
            return last.detach() if last.requires_grad else last
        if last.numel() == 0:
            return None
        return last.detach().reshape(()) if last.numel() == 1 else last.detach().amax()

    def arm(self, kinds: frozenset[int]) -> None:
        """Also set the module's observer when quantization statistics are wanted."""
        super().arm(kinds)
        if kinds & {KIND_WEIGHT, KIND_INPUT, KIND_GRAD} and hasattr(self.module, "observer"):
            setattr(self.module, "observer", self._observe)  # noqa: B010 (an attribute of the protocol, not nn.Module)
            if self._batches and self.deferred is not None:
                setattr(self.module, "stats_batch", self.deferred.batch)  # noqa: B010

    def disarm(self) -> None:
        """Also clear the observer: the module does no statistics work again."""
        super().disarm()
        if hasattr(self.module, "observer"):
            setattr(self.module, "observer", None)  # noqa: B010
        if self._batches:
            setattr(self.module, "stats_batch", None)  # noqa: B010

    def _observe(self, kind: str, stats: ErrorStats) -> None:
        if self._in_reference:
            return
        index = _OBSERVER_KINDS.get(kind)
        if index is not None and index in self.kinds:
            self.record(index, stats)  # a list append: timing it would cost more than it does
        deferred = self.deferred
        if self._batches and deferred is not None:
            if index != KIND_GRAD:
                deferred.forward_pending = True
            elif deferred.forward_pending:
                deferred.flush()
