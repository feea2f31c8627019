"""``attach()`` and the :class:`Monitor` it returns: the front object of the agent.

Layering (HOUSE_STYLE): hooks (gated, cheap; :mod:`~quantwatch.agent.layers`) → statistics kept on the device and
reduced into one tensor per sampled step (here) → batch engine (bounded, drop-oldest, counted) → exporter (HTTP,
retry, spool).  On an unsampled step the model runs without any agent hook installed; :meth:`Monitor.step` then
only compares two integers and reads the clock.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from quantwatch.agent.actions import ActionLoop, Alert
from quantwatch.agent.adapters import (
    AdapterContext,
    Found,
    LayerInfo,
    build_layer_adapters,
    dequantize_shadow,
    find_layers,
)
from quantwatch.agent.adapters.linear import high_precision_data
from quantwatch.agent.adapters.quantwatch_layers import KernelEntry
from quantwatch.agent.comparison import comparison_stats
from quantwatch.agent.destination import make_exporter
from quantwatch.agent.engine import BatchEngine, DeliveryResult, PendingStep
from quantwatch.agent.errors import ConfigError
from quantwatch.agent.exporters import Exporter, RetryPolicy
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.fingerprint import RankReporter
from quantwatch.agent.layers import (
    KIND_DRIFT,
    KIND_GRAD,
    KIND_INPUT,
    KIND_WEIGHT,
    DeferredStatistics,
    LayerAdapter,
    OverheadClock,
)
from quantwatch.agent.readout import ESTIMATED_METRICS, NF, ROW, SUMS, DeviceReader, derive, metric_kinds
from quantwatch.agent.sampling import Schedule
from quantwatch.agent.scalars import agent_scalars, scalar_step, split_scalars
from quantwatch.agent.shadow import LossClosure, OptimizerFactory, ShadowModel, ShadowOptions
from quantwatch.agent.validation import check_run, check_shadow, check_step_options, detect_rank, periods, reports
from quantwatch.agent.whatif import WhatIf
from quantwatch.agent.wire import Encoding, StepRecord, wire_formats
from quantwatch.agent.wrappers import CompiledRegions, unwrap
from quantwatch.kernels import native as native_kernels
from quantwatch.protocol import LAYER_METRICS

__all__ = ["DEFAULT_EVERY", "Monitor", "attach"]

# Sampling one step in 25 keeps the agent's cost at defaults near 3% of a step even where statistics are emulated on
# the CPU (bench/agent_overhead.py); users who want more pass every=1..N.
DEFAULT_EVERY = 25
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("quantwatch.agent")

_MONITORS: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for monitor in list(_MONITORS):
        monitor.close(timeout_seconds=5.0)


class Monitor:
    """Measures the monitored layers on sampled steps and streams the figures; made by :func:`attach`.

    Call :meth:`step` once per optimizer step; it never raises.  Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        *,
        model: nn.Module,
        run: str,
        rank: int,
        reporting: bool,
        found: Mapping[str, Found],
        reference_dtype: str,
        schedule: Schedule,
        engine: BatchEngine | None,
        shadow: ShadowModel | None,
        tokens_per_step: float | None,
        scalars_every: int,
        failures: FailureLog,
        shadow_options: ShadowOptions | None = None,
        rank_reporter: RankReporter | None = None,
        whatif_every: int | None = None,
    ) -> None:
        self.run = run
        self.rank = rank
        self.reporting = reporting
        self.schedule = schedule
        self.failures = failures
        self._engine = engine
        self._rank_reporter = rank_reporter
        self._shadow = shadow
        self._tokens_per_step = tokens_per_step
        self._scalars_every = scalars_every
        self._clock = OverheadClock()
        self._lock = threading.Lock()
        self._model = model
        self._deferred = DeferredStatistics(failures, self._clock)
        self._hooks: list[RemovableHandle] = []  # while armed: the model's forward hook, the optimizer's pre-hook
        self._compiled = CompiledRegions(model)  # run eagerly while hooked: the agent never makes Dynamo recompile
        self._context = AdapterContext(failures, self._clock, self._deferred, reference_dtype)
        self._adapters, self._infos = build_layer_adapters(found, self._context)
        self._whatif = WhatIf(whatif_every, found, self._infos, failures, self._clock)
        for index, adapter in enumerate(self._adapters):
            adapter.configure(shadow_options or ShadowOptions(), index)
        self._wire_formats = {str(info): wire_formats(str(info), info.formats) for info in self._infos}
        self._wire_layers = self._layers_on_the_wire()
        first_param = next(model.parameters(), None)
        self._device = first_param.device if first_param is not None else torch.device("cpu")
        if reporting and self._device.type == "cpu":
            native_kernels.prepare_in_background()  # one-pass CPU statistics, once built; NumPy's until then
        self._nan_row = torch.full((NF,), float("nan"), dtype=torch.float64, device=self._device)
        self._nan_scale = torch.full((), float("nan"), device=self._device)
        self._steps_seen = 0
        self._sampled_steps = 0
        self._next_step = 0
        self._armed: frozenset[str] = frozenset()
        self._next_sampled: int | None = schedule.next_step(0) if reporting else None
        self._last_step_time = time.perf_counter()
        self._window_seconds = 0.0
        self._closed = False
        self._loop = ActionLoop(self, min(schedule.periods.values()), engine.exporter if engine is not None else None)
        self._arm(self._metrics_at(0), 0)
        _MONITORS.add(self)

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def layers(self) -> tuple[LayerInfo, ...]:
        """The monitored layers and kernels, in the order of the metric arrays: each a
        :class:`~quantwatch.agent.adapters.LayerInfo`, its qualified name (a ``str``) with ``.adapter`` (which adapter
        measures it) and ``.formats`` (format per tensor kind: ``weight``, ``input``, ``grad``)."""
        with self._lock:
            return tuple(self._infos)

    def layer_formats(self) -> list[dict[str, str]]:
        """Each monitored layer's format per tensor kind (``{"weight": "fp8_e4m3:tensor", "input": ..., "grad":
        ...}``), aligned with :attr:`layers`."""
        return [dict(info.formats) for info in self.layers]

    @property
    def shadow_model(self) -> nn.Module | None:
        """The FP32 shadow model (``shadow="model"``), else None."""
        return self._shadow.model if self._shadow is not None else None

    def step(
        self,
        step: int | None = None,
        /,
        *,
        shadow_closure: LossClosure | None = None,
        tokens: float | None = None,
        **scalars: float | Tensor,
    ) -> None:
        """Mark the end of optimizer step ``step`` (default: one more than the last) with run scalars as keywords
        (``loss=loss``; tensors are read on the exporter thread, never here).

        ``tokens`` (or ``tokens_per_step`` at attach) gives ``tokens_per_second``; with ``shadow="model"``,
        ``shadow_closure(shadow_model) -> loss`` trains the FP32 shadow one step on the same batch.  Never raises."""
        if self._closed:
            return
        try:
            with self._clock.measure():
                self._step(step, shadow_closure, tokens, scalars)
        except Exception as exc:
            self.failures.record("step", f"monitor.step failed: {exc}", exc)

    def on_alert(self, callback: Callable[[Alert], object]) -> None:
        """Call ``callback(alert)`` once per alert episode firing on the run, on the training thread in the next
        :meth:`step`, never mid-step; its exceptions are logged, never raised (:mod:`quantwatch.agent.actions`)."""
        self._loop.on_alert(callback)

    @property
    def should_stop(self) -> bool:
        """True once ``qw.actions.stop_training()`` took effect: the training loop should end."""
        return self._loop.should_stop

    def expect_step(self, step: int) -> None:
        """Say that the first :meth:`step` will be for ``step`` (a run resumed from a checkpoint, or a trainer that
        counts optimizer steps from 1): the hooks are armed for what that step samples. Raises ConfigError for a
        negative step or once a step was made."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError("step", f"must be an integer >= 0, got {step!r}")
        if self._steps_seen:
            raise ConfigError("step", "expect_step() must come before the first step()")
        if self._next_sampled is None:
            return
        if self._armed:
            self._armed = frozenset()
            with self._lock:
                self._disarm(list(self._adapters))
        self._next_step = step
        self._next_sampled = self.schedule.next_step(step)
        self._arm(self._metrics_at(step), step)

    def watch_kernel(self, fn: F, name: str) -> F:
        """Wrap a quantization kernel ``q = fn(x, ...)``; on sampled steps the error of ``q`` against ``x`` is
        recorded as layer ``name``.  Raises ConfigError for an empty or already used name."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", "a watched kernel needs a non-empty name")
        if name in self.layers:
            raise ConfigError("name", f"{name!r} is already a monitored layer or kernel")
        adapter = KernelEntry.create(name, self._context)
        with self._lock:
            self._adapters.append(adapter)
            self._infos.append(LayerInfo(name, KernelEntry.name, KernelEntry.formats))
            self._wire_formats[name] = wire_formats(name, KernelEntry.formats)
            self._wire_layers = self._layers_on_the_wire()
            if self._armed:
                adapter.arm(metric_kinds(self._armed))
        return adapter.wrap(fn)

    def kernel(self, name: str) -> Callable[[F], F]:
        """Decorator form of :meth:`watch_kernel`: ``@monitor.kernel("fp4_cast")``."""

        def decorate(fn: F) -> F:
            return self.watch_kernel(fn, name)

        return decorate

    def save_shadow(self, path: str | os.PathLike[str]) -> None:
        """Write the FP32 shadow model's state dict to ``path`` (needs ``shadow="model"``)."""
        if self._shadow is None:
            raise ConfigError("shadow", "save_shadow() needs attach(..., shadow='model')")
        self._shadow.save(path)

    def flush(self, timeout_seconds: float = 10.0) -> DeliveryResult:
        """Send everything recorded so far, then the spool, retrying transient failures for up to
        ``timeout_seconds``.  The :class:`DeliveryResult` is true when nothing is left only in memory; its ``delivered``
        says whether the collector has it all (``spool_batches`` counts what waits on disk)."""
        if self._engine is None:
            return DeliveryResult(True)
        return DeliveryResult(self._engine.flush(timeout_seconds), self._engine.spooled_batches())

    def close(self, timeout_seconds: float = 10.0) -> DeliveryResult:
        """Remove every hook, flush (the spool included, retrying a collector that is restarting) and stop the
        exporter, within ``timeout_seconds``.  Returns a :class:`DeliveryResult` as :meth:`flush` and logs once whether
        the spool is empty; what stays in it is delivered by the next process of this run or by
        ``quantwatch replay SPOOL_DIR``."""
        if self._closed:
            return DeliveryResult(True, self._engine.spooled_batches() if self._engine is not None else 0)
        self._closed = True
        self._disarm(list(self._adapters))
        if self._engine is None:
            return DeliveryResult(True)
        result = DeliveryResult(self._engine.close(timeout_seconds), self._engine.spooled_batches())
        spool = getattr(self._engine.exporter, "spool", None)
        if result.spool_batches:
            logger.warning(
                "quantwatch agent: closed with %d batches in the spool at %s; the next process of run %r delivers "
                "them, or `quantwatch replay %s`",
                result.spool_batches,
                getattr(spool, "directory", "?"),
                self.run,
                getattr(spool, "directory", "SPOOL_DIR"),
            )
        elif spool is not None:
            logger.info("quantwatch agent: closed; the spool is empty (the collector has every batch)")
        return result

    def stats(self) -> dict[str, Any]:
        """Local counters: steps seen and sampled, steps queued/dropped, exporter counters, failures by kind."""
        out: dict[str, Any] = {"steps": self._steps_seen, "sampled_steps": self._sampled_steps}
        if self._engine is not None:
            out["queued_steps"] = self._engine.queued_steps()
            out["dropped_steps"] = self._engine.dropped_steps
            out.update(self._engine.exporter.counters())
        out["failures"] = self.failures.counts()
        return out

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------- internals

    def _metrics_at(self, step: int) -> frozenset[str]:
        """The metrics measured at ``step``; empty unless it is the next sampled step (the gate: one integer
        comparison then)."""
        if self._next_sampled is not None and self._next_sampled < step:
            self._next_sampled = self.schedule.next_step(step)
        if self._next_sampled != step:
            return frozenset()
        return self.schedule.metrics_at(step)

    def _arm(self, metrics: frozenset[str], step: int) -> None:
        """Install the hooks that measuring ``metrics`` at ``step`` needs (none for an empty set)."""
        if not metrics:
            return
        self._armed = metrics
        self._whatif.arm(self._sampled_steps, step)
        self._compiled.run_eager()
        kinds = metric_kinds(metrics)
        with self._lock:
            for adapter in self._adapters:
                adapter.arm(kinds)
        if kinds & {KIND_WEIGHT, KIND_INPUT, KIND_GRAD}:
            self._hooks = [
                self._model.register_forward_hook(self._deferred.on_model_forward),
                register_optimizer_step_pre_hook(self._deferred.on_optimizer_step),
            ]

    def _end_step(self, adapters: list[LayerAdapter]) -> None:
        """Between two sampled steps that need the same hooks: keep them; compute the deferred statistics."""
        for adapter in adapters:
            adapter.end_step()
        self._deferred.flush()

    def _disarm(self, adapters: list[LayerAdapter]) -> None:
        """Remove every hook; compute the deferred statistics of the step."""
        self._compiled.run_compiled()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._whatif.disarm()
        for adapter in adapters:
            adapter.disarm()
        self._deferred.flush()

    def _step(
        self, step: int | None, shadow_closure: LossClosure | None, tokens: float | None, scalars: dict[str, Any]
    ) -> None:
        now = time.perf_counter()
        step_seconds = now - self._last_step_time
        self._last_step_time = now
        self._window_seconds += step_seconds
        self._steps_seen += 1
        current = self._next_step if step is None else int(step)
        if current < 0:
            self.failures.record("step_number", f"step must be >= 0, got {current}; counting on instead")
            current = self._next_step
        self._next_step = current + 1
        if not self.reporting and self._rank_reporter is not None and self._engine is not None:
            self._rank_reporter.submit_alone(self._engine, current)
        shadow_loss = None
        if self._shadow is not None:
            if shadow_closure is None:
                self.failures.record("shadow_closure_missing", "shadow='model' needs monitor.step(shadow_closure=...)")
            else:
                try:
                    shadow_loss = self._shadow.train_step(shadow_closure)
                except Exception as exc:
                    self.failures.record("shadow_step", f"the shadow model's step failed: {exc}", exc)
        upcoming = self._metrics_at(current + 1)
        if self._armed:
            armed = self._armed
            with self._lock:
                adapters = list(self._adapters)
            if upcoming and metric_kinds(upcoming) == metric_kinds(armed):
                # every=1 and the like: the next step needs the same hooks, so they stay (removing and installing
                # them again costs more than a step's comparisons of a small layer).
                self._armed = upcoming
                self._end_step(adapters)
                upcoming = frozenset()
            else:
                self._armed = frozenset()
                self._disarm(adapters)
            self._sampled_steps += 1
            self._submit(current, armed, adapters, step_seconds, tokens, shadow_loss, scalars)
            if self._armed:  # kept armed for the next step: its what-if hooks too, when it is a what-if step
                self._whatif.arm(self._sampled_steps, current + 1)
        elif (scalars or shadow_loss is not None) and current % self._scalars_every == 0:
            self._submit_scalars(current, step_seconds, tokens, shadow_loss, scalars)
        self._loop.boundary(current)
        self._arm(upcoming, current + 1)

    def _submit_scalars(
        self, step: int, step_seconds: float, tokens: float | None, shadow_loss: Tensor | None, scalars: dict[str, Any]
    ) -> None:
        """An unsampled step's scalars, with its time and throughput, in the batches the sampled steps fill."""
        if self._engine is None or not self.reporting:
            return
        numbers, names, tensors = split_scalars(
            scalars if shadow_loss is None else {**scalars, "loss_shadow": shadow_loss}, self._device, self.failures
        )
        numbers["step_seconds"] = step_seconds
        tokens = tokens if tokens is not None else self._tokens_per_step
        if tokens is not None and step_seconds > 0:
            numbers["tokens_per_second"] = float(tokens) / step_seconds
        layers, formats = self._wire_layers
        self._engine.submit(PendingStep(layers, scalar_step(step, numbers, names, tensors), formats))

    def _layers_on_the_wire(self) -> tuple[tuple[str, ...], tuple[Mapping[str, str] | None, ...]]:
        """The layer names and their wire formats, as every step's record carries them (kept, not rebuilt per step)."""
        layers = tuple(str(info) for info in self._infos)
        return layers, tuple(self._wire_formats.get(n) for n in layers)

    def _submit(
        self,
        step: int,
        armed: frozenset[str],
        adapters: list[LayerAdapter],
        step_seconds: float,
        tokens: float | None,
        shadow_loss: Tensor | None,
        user_scalars: dict[str, Any],
    ) -> None:
        if "weight_drift_rel_l2" in armed and self._shadow is not None:
            for adapter in adapters:
                shadow_weight, weight = self._shadow.weights.get(adapter.name), adapter.weight
                if shadow_weight is not None and weight is not None:  # a torchao wrapper's data: numpy takes no wrapper
                    pair = high_precision_data(shadow_weight), high_precision_data(weight)
                    adapter.record(KIND_DRIFT, comparison_stats(*pair, batch=self._deferred.batch))
        rows: list[Tensor] = []
        present: list[list[bool]] = []
        scales: list[Tensor] = []
        estimated_kinds: set[int] = set()
        device, nan_row, with_scale, on_cpu = self._device, self._nan_row, "scale" in armed, self._device.type == "cpu"
        for adapter in adapters:
            estimated_kinds |= adapter.take_estimated()
            taken = adapter.take()
            present.append([s is not None for s in taken])
            for stats in taken:
                # Few, cheap torch calls per layer (is_cpu, not a device made to compare): each costs more here.
                row = nan_row if stats is None else stats.as_tensor()
                rows.append(row if (row.is_cpu if on_cpu else row.device == device) else row.to(device))
            scale = adapter.scale() if with_scale else None
            present[-1].append(scale is not None)
            same = scale is None or (scale.is_cpu if on_cpu else scale.device == device)
            scales.append(self._nan_scale if scale is None else scale if same else scale.to(device))
        if scales:  # every layer's scale after every layer's sums: one float64 conversion for all of them
            rows.append(torch.stack(scales).to(torch.float64))

        overhead = self._clock.seconds / self._window_seconds if self._window_seconds > 0 else None
        self._clock.seconds = 0.0
        self._window_seconds = 0.0
        tokens = tokens if tokens is not None else self._tokens_per_step
        host_scalars = agent_scalars(step_seconds, overhead, tokens, self._device, self._engine, self.failures)

        if shadow_loss is not None:
            user_scalars = {**user_scalars, "loss_shadow": shadow_loss}
        numbers, tensor_names, tensor_values = split_scalars(user_scalars, self._device, self.failures)
        host_scalars.update(numbers)

        packed = torch.cat([*rows, *tensor_values]) if rows or tensor_values else torch.zeros(0, dtype=torch.float64)
        reader = DeviceReader(packed)
        layers = tuple(a.name for a in adapters)
        wall_time = time.time()
        metric_names = [m for m in LAYER_METRICS if m in armed]
        estimated = frozenset(m for k in estimated_kinds for m in ESTIMATED_METRICS.get(k, ()) if m in armed)
        rank_extras = self._rank_reporter.capture(layers) if self._rank_reporter is not None else None
        whatif = self._whatif.take(layers)

        def resolve() -> StepRecord:
            values = reader.read()
            n = len(layers)
            sums, scales = values[: n * SUMS].reshape(n, SUMS), values[n * SUMS : n * ROW]
            metrics = derive(np.concatenate([sums, scales[:, None]], axis=1), present, metric_names)
            scalars = dict(host_scalars)
            scalars.update(zip(tensor_names, values[n * ROW :].tolist(), strict=True))
            extras = (*(rank_extras() if rank_extras is not None else (None, None)), whatif() if whatif else None)
            return StepRecord(step, wall_time, metrics, scalars, estimated & metrics.keys(), *extras)

        if self._engine is not None:
            formats = tuple(self._wire_formats.get(n) for n in layers)
            self._engine.submit(PendingStep(layers, resolve, formats))


def attach(
    model: nn.Module,
    run: str | None = None,
    url: str | None = None,
    *,
    every: int = DEFAULT_EVERY,
    start: int = 0,
    end: int | None = None,
    metrics: Sequence[str] | Mapping[str, int] | None = None,
    layers: str | Sequence[str] | None = None,
    token: str | None = None,
    rank: int | None = None,
    ranks: Literal["all", "first"] | Iterable[int] = "all",
    shadow: Literal["layer", "model"] = "layer",
    shadow_optimizer: OptimizerFactory | None = None,
    shadow_rows: float | None = None,
    reference_dtype: Literal["float32", "bfloat16"] = "float32",
    tokens_per_step: float | None = None,
    scalars_every: int = 1,
    whatif_every: int | None = None,
    exporter: Exporter | None = None,
    encoding: Encoding = "msgpack",
    compress: bool = True,
    spool_dir: str | os.PathLike[str] | None = None,
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
    max_queue_steps: int = 2048,
    max_batch_steps: int = 64,
    flush_interval_seconds: float = 2.0,
    request_timeout_seconds: float = 10.0,
    retry: RetryPolicy | None = None,
    replica_group: Iterable[int] | None = None,
) -> Monitor:
    """Attach the agent to ``model`` and return its :class:`Monitor`.

    Monitored are the modules a registered adapter recognises (:mod:`quantwatch.agent.adapters`: QuantWatch's own
    layers, torch.ao and torchao QAT, torchao float8 / MXFP8 / NVFP4 training, and :func:`register_adapter`'s),
    optionally narrowed by ``layers`` (glob patterns on qualified names).  ``every``/``start``/``end`` set the
    sampling window (``end`` exclusive); ``metrics`` is a list of metric names or a mapping name → period.  Figures
    go to ``url`` (collector base URL, or ``file:///path.jsonl`` for a JSON-lines file; env ``QUANTWATCH_URL``,
    default ``http://127.0.0.1:8000``) or to a given ``exporter``.  ``rank`` defaults to ``torch.distributed``'s
    (or env ``RANK``); ``ranks`` picks which ranks report.  ``shadow="model"`` also trains an FP32 copy (optimizer
    from ``shadow_optimizer(params)``).
    ``shadow_rows`` (a fraction 0 < f <= 1 or a row count >= 1; default exact) estimates ``output_*`` and
    ``update_cosine`` of ``nn.Linear`` layers from a seeded subset of rows (:mod:`quantwatch.agent.rows`; such figures
    are named in ``StepRecord.estimated``); ``reference_dtype`` (``"float32"``, autocast off, or ``"bfloat16"``) is
    the precision of the layer references (:func:`quantwatch.agent.shadow.run_reference`).
    Scalars given to :meth:`Monitor.step` go out for every step (``scalars_every``: every N-th) whatever the
    sampling; :mod:`~quantwatch.agent.whatif` statistics come every 250 steps whatever ``every`` (``whatif_every=N``:
    every N-th sampled step; 0: none).  Every rank sends weight fingerprints whatever ``ranks`` says
    (:mod:`~quantwatch.agent.fingerprint`; its replica group is detected or ``replica_group``) and its environment once.

    Raises :class:`ConfigError` naming the field for configuration mistakes; nothing raises after this returns.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
    run = check_run(run or os.environ.get("QUANTWATCH_RUN"))
    check_shadow(shadow)
    if shadow == "model" and shadow_optimizer is None:
        raise ConfigError("shadow_optimizer", "shadow='model' needs shadow_optimizer=lambda params: ...")
    check_step_options(tokens_per_step, scalars_every, whatif_every)
    schedule = Schedule(periods(metrics, every, shadow), start=start, end=end)
    shadow_options = ShadowOptions.parse(reference_dtype, shadow_rows)
    found = find_layers(model, layers)
    detected_rank = detect_rank(rank)
    reporting = reports(detected_rank, ranks)
    failures = FailureLog()
    rank_reporter = RankReporter.for_model(model, found, detected_rank, replica_group, schedule, failures)
    engine = None
    shadow_model = None
    if reporting or rank_reporter.fingerprints:
        if reporting and shadow == "model" and shadow_optimizer is not None:
            shadow_model = ShadowModel(unwrap(model), found, shadow_optimizer)
            dequantize_shadow(shadow_model.model, found)
        chosen = make_exporter(
            url,
            exporter,
            token=token,
            encoding=encoding,
            compress=compress,
            spool_dir=spool_dir,
            spool_max_bytes=spool_max_bytes,
            run=run,
            rank=detected_rank,
            failures=failures,
            retry=retry,
            timeout_seconds=request_timeout_seconds,
        )
        try:
            engine = BatchEngine(
                chosen,
                run=run,
                rank=detected_rank,
                max_queue_steps=max_queue_steps,
                max_batch_steps=max_batch_steps,
                max_delay_seconds=flush_interval_seconds,
                failures=failures,
            )
        except ValueError as exc:
            raise ConfigError("max_queue_steps", str(exc)) from exc
    return Monitor(
        model=model,
        run=run,
        rank=detected_rank,
        reporting=reporting,
        found=found if reporting else {},
        reference_dtype=reference_dtype,
        schedule=schedule,
        engine=engine,
        shadow=shadow_model,
        tokens_per_step=tokens_per_step,
        scalars_every=scalars_every,
        failures=failures,
        shadow_options=shadow_options,
        rank_reporter=rank_reporter,
        whatif_every=whatif_every,
    )
