"""``attach()`` and the :class:`Monitor` it returns: the front object of the agent.

Layering (HOUSE_STYLE): hooks (gated, cheap; :mod:`~quantwatch.agent.layers`) → statistics kept on the device and
reduced into one tensor per sampled step (here) → batch engine (bounded, drop-oldest, counted) → exporter (HTTP,
retry, spool).  On an unsampled step the model runs without any agent hook installed; :meth:`Monitor.step` then
only compares two integers and reads the clock.
"""

from __future__ import annotations

import atexit
import fnmatch
import hashlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from quantwatch.agent.engine import BatchEngine, PendingStep
from quantwatch.agent.errors import ConfigError
from quantwatch.agent.exporters import Exporter, HttpExporter, JsonLinesExporter, RetryPolicy
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.layers import (
    KIND_DRIFT,
    KIND_GRAD,
    KIND_INPUT,
    KIND_NAMES,
    KIND_OUTPUT,
    KIND_UPDATE,
    KIND_WEIGHT,
    DeferredStatistics,
    KernelAdapter,
    LayerAdapter,
    ModuleAdapter,
    OverheadClock,
    QatAdapter,
    comparison_stats,
    is_monitorable,
)
from quantwatch.agent.sampling import Schedule
from quantwatch.agent.shadow import LossClosure, OptimizerFactory, ShadowModel
from quantwatch.agent.spool import DiskSpool
from quantwatch.agent.wire import Encoding, StepRecord
from quantwatch.kernels import ErrorStats
from quantwatch.kernels import native as native_kernels
from quantwatch.protocol import LAYER_METRICS, RUN_NAME_PATTERN, RUN_NAME_RULE

__all__ = ["DEFAULT_EVERY", "DEFAULT_METRICS", "Monitor", "attach"]

# Sampling one step in 25 keeps the agent's cost at defaults near 3% of a step even where statistics are emulated on
# the CPU (bench/agent_overhead.py); users who want more pass every=1..N.
DEFAULT_EVERY = 25
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024
# Which measurements each metric needs on a sampled step.
_METRIC_KINDS: dict[str, frozenset[int]] = {
    "weight_rel_l2": frozenset({KIND_WEIGHT}),
    "act_rel_l2": frozenset({KIND_INPUT}),
    "grad_rel_l2": frozenset({KIND_GRAD}),
    "output_rel_l2": frozenset({KIND_OUTPUT}),
    "output_cosine": frozenset({KIND_OUTPUT}),
    "output_sqnr_db": frozenset({KIND_OUTPUT}),
    "update_cosine": frozenset({KIND_UPDATE}),
    "underflow_ratio": frozenset({KIND_INPUT}),
    "overflow_ratio": frozenset({KIND_INPUT}),
    "nonfinite_count": frozenset({KIND_WEIGHT, KIND_INPUT, KIND_GRAD}),
    "amax": frozenset({KIND_INPUT}),
    "scale": frozenset({KIND_INPUT}),
    "weight_drift_rel_l2": frozenset({KIND_DRIFT}),
}
#: Measured by default (the catalogued metrics this agent measures); ``weight_drift_rel_l2`` joins them with
#: ``shadow="model"``.
DEFAULT_METRICS: tuple[str, ...] = tuple(m for m in LAYER_METRICS if m != "weight_drift_rel_l2" and m in _METRIC_KINDS)

_FIELDS = ErrorStats.FIELDS
_NF = len(_FIELDS)
_NK = len(KIND_NAMES)
_SUMS = _NK * _NF  # per layer: every kind's partial sums (the scales follow those of every layer)
_ROW = _SUMS + 1  # per layer, as `_derive` takes them: the sums, then the scale
_SCALAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,199}")

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("quantwatch.agent")

_MONITORS: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for monitor in list(_MONITORS):
        monitor.close(timeout_seconds=5.0)


def _detect_rank(rank: int | None) -> int:
    if rank is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ConfigError("rank", f"must be an integer >= 0, got {rank!r}")
        return rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    env = os.environ.get("RANK", "0")
    if not env.isdigit():
        raise ConfigError("rank", f"environment variable RANK must be an integer >= 0, got {env!r}")
    return int(env)


def _reports(rank: int, ranks: str | Iterable[int]) -> bool:
    if ranks == "all":
        return True
    if ranks == "first":
        return rank == 0
    if isinstance(ranks, str):
        raise ConfigError("ranks", f"must be 'all', 'first' or a list of ranks, got {ranks!r}")
    chosen = list(ranks)
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in chosen):
        raise ConfigError("ranks", f"a list of ranks must hold integers >= 0, got {chosen!r}")
    return rank in chosen


def _periods(metrics: Sequence[str] | Mapping[str, int] | None, every: int, shadow: str) -> dict[str, int]:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError("every", f"must be an integer >= 1, got {every!r}")
    if metrics is None:
        names: list[str] = list(DEFAULT_METRICS)
        if shadow == "model":
            names.append("weight_drift_rel_l2")
        return dict.fromkeys(names, every)
    if isinstance(metrics, str):
        raise ConfigError("metrics", "must be a list of metric names or a mapping name -> period, not a string")
    periods = dict(metrics) if isinstance(metrics, Mapping) else dict.fromkeys(metrics, every)
    for name in periods:
        if name not in LAYER_METRICS:
            raise ConfigError("metrics", f"unknown metric {name!r}; known: {', '.join(LAYER_METRICS)}")
        if name not in _METRIC_KINDS:
            raise ConfigError("metrics", f"{name!r} is catalogued but not measured by this agent yet")
    if "weight_drift_rel_l2" in periods and shadow != "model":
        raise ConfigError("metrics", "weight_drift_rel_l2 needs shadow='model'")
    return periods


def _spool_directory(spool_dir: str | os.PathLike[str] | None, run: str, rank: int) -> Path:
    base = spool_dir or os.environ.get("QUANTWATCH_SPOOL_DIR") or Path.home() / ".cache" / "quantwatch" / "spool"
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", run)[:80]
    digest = hashlib.sha256(run.encode()).hexdigest()[:12]
    return Path(base) / f"{readable}-{digest}" / f"rank-{rank}"


def _make_exporter(
    url: str | None,
    exporter: Exporter | None,
    *,
    token: str | None,
    encoding: Encoding,
    compress: bool,
    spool_dir: str | os.PathLike[str] | None,
    spool_max_bytes: int,
    run: str,
    rank: int,
    failures: FailureLog,
    retry: RetryPolicy | None,
    timeout_seconds: float,
) -> Exporter:
    if exporter is not None:
        if url is not None:
            raise ConfigError("exporter", "give either url= or exporter=, not both")
        if not isinstance(exporter, Exporter):
            raise ConfigError("exporter", "must implement export(batch), idle(), shutdown(), close(), counters()")
        return exporter
    url = url or os.environ.get("QUANTWATCH_URL") or DEFAULT_URL
    if not isinstance(url, str):
        raise ConfigError("url", f"must be a string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme == "file":
        if not parts.path:
            raise ConfigError("url", f"a file URL needs a path, got {url!r}")
        return JsonLinesExporter(parts.path, failures=failures)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise ConfigError("url", f"must be http(s)://host[:port][/prefix] or file:///path.jsonl, got {url!r}")
    if encoding not in ("msgpack", "json"):
        raise ConfigError("encoding", f"must be 'msgpack' or 'json', got {encoding!r}")
    if not isinstance(spool_max_bytes, int) or spool_max_bytes < 0:
        raise ConfigError("spool_max_bytes", f"must be an integer >= 0 (0 disables the spool), got {spool_max_bytes!r}")
    spool = None
    if spool_max_bytes > 0:
        directory = _spool_directory(spool_dir, run, rank)
        try:
            spool = DiskSpool(directory, spool_max_bytes)
        except OSError as exc:
            raise ConfigError("spool_dir", f"cannot use {directory}: {exc}") from exc
    token = token or os.environ.get("QUANTWATCH_TOKEN") or None
    return HttpExporter(
        url,
        token=token,
        encoding=encoding,
        compress=compress,
        spool=spool,
        failures=failures,
        retry=retry,
        timeout_seconds=timeout_seconds,
    )


def _find_layers(model: nn.Module, layers: str | Sequence[str] | None) -> dict[str, nn.Module]:
    candidates = {name: m for name, m in model.named_modules() if name and is_monitorable(m)}
    if layers is None:
        return candidates
    patterns = [layers] if isinstance(layers, str) else list(layers)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError("layers", f"must be a glob pattern or a list of them, got {layers!r}")
    chosen = {n: m for n, m in candidates.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if not chosen:
        known = ", ".join(list(candidates)[:20]) or "none"
        raise ConfigError("layers", f"no quantized layer matches {patterns}; quantized layers: {known}")
    return chosen


def _resident_memory_bytes() -> float | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return float(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return None


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
        modules: Mapping[str, nn.Module],
        schedule: Schedule,
        engine: BatchEngine | None,
        shadow: ShadowModel | None,
        tokens_per_step: float | None,
        failures: FailureLog,
    ) -> None:
        self.run = run
        self.rank = rank
        self.reporting = reporting
        self.schedule = schedule
        self.failures = failures
        self._engine = engine
        self._shadow = shadow
        self._tokens_per_step = tokens_per_step
        self._clock = OverheadClock()
        self._lock = threading.Lock()
        self._model = model
        self._deferred = DeferredStatistics(failures, self._clock)
        self._model_hook: RemovableHandle | None = None
        self._optimizer_hook: RemovableHandle | None = None
        self._adapters: list[LayerAdapter] = []
        for name, module in modules.items():
            if callable(getattr(module, "reference_forward", None)):
                self._adapters.append(ModuleAdapter(name, module, failures, self._clock, self._deferred))
            else:
                self._adapters.append(QatAdapter(name, module, failures, self._clock, self._deferred))
        first_param = next(model.parameters(), None)
        self._device = first_param.device if first_param is not None else torch.device("cpu")
        if reporting and self._device.type == "cpu":
            native_kernels.prepare_in_background()  # one-pass CPU statistics, once built; NumPy's until then
        self._nan_row = torch.full((_NF,), float("nan"), dtype=torch.float64, device=self._device)
        self._nan_scale = torch.full((), float("nan"), device=self._device)
        self._steps_seen = 0
        self._sampled_steps = 0
        self._next_step = 0
        self._armed: frozenset[str] = frozenset()
        self._next_sampled: int | None = schedule.next_step(0) if reporting else None
        self._last_step_time = time.perf_counter()
        self._window_seconds = 0.0
        self._closed = False
        self._arm(self._metrics_at(0))
        _MONITORS.add(self)

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def layers(self) -> tuple[str, ...]:
        """Names of the monitored layers and kernels, in the order of the metric arrays."""
        return tuple(a.name for a in self._adapters)

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

    def watch_kernel(self, fn: F, name: str) -> F:
        """Wrap a quantization kernel ``q = fn(x, ...)``; on sampled steps the error of ``q`` against ``x`` is
        recorded as layer ``name``.  Raises ConfigError for an empty or already used name."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", "a watched kernel needs a non-empty name")
        if name in self.layers:
            raise ConfigError("name", f"{name!r} is already a monitored layer or kernel")
        adapter = KernelAdapter(name, self.failures, self._clock)
        with self._lock:
            self._adapters.append(adapter)
            if self._armed:
                adapter.arm(self._kinds(self._armed))
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

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Send everything recorded so far; True when done within ``timeout_seconds``."""
        return self._engine.flush(timeout_seconds) if self._engine is not None else True

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Remove every hook, flush and stop the exporter (what cannot be sent in time is spooled when possible)."""
        if self._closed:
            return True
        self._closed = True
        self._disarm(list(self._adapters))
        return self._engine.close(timeout_seconds) if self._engine is not None else True

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
    @staticmethod
    def _kinds(metrics: frozenset[str]) -> frozenset[int]:
        kinds: set[int] = set()
        for metric in metrics:
            kinds |= _METRIC_KINDS[metric]
        return frozenset(kinds)

    def _metrics_at(self, step: int) -> frozenset[str]:
        """The metrics measured at ``step``; empty unless it is the next sampled step (the gate: one integer
        comparison then)."""
        if self._next_sampled is not None and self._next_sampled < step:
            self._next_sampled = self.schedule.next_step(step)
        if self._next_sampled != step:
            return frozenset()
        return self.schedule.metrics_at(step)

    def _arm(self, metrics: frozenset[str]) -> None:
        """Install the hooks that measuring ``metrics`` needs (none for an empty set)."""
        if not metrics:
            return
        self._armed = metrics
        kinds = self._kinds(metrics)
        with self._lock:
            for adapter in self._adapters:
                adapter.arm(kinds)
        if kinds & {KIND_WEIGHT, KIND_INPUT, KIND_GRAD}:
            self._model_hook = self._model.register_forward_hook(self._deferred.on_model_forward)
            self._optimizer_hook = register_optimizer_step_pre_hook(self._deferred.on_optimizer_step)

    def _end_step(self, adapters: list[LayerAdapter]) -> None:
        """Between two sampled steps that need the same hooks: keep them; compute the deferred statistics."""
        for adapter in adapters:
            adapter.end_step()
        self._deferred.flush()

    def _disarm(self, adapters: list[LayerAdapter]) -> None:
        """Remove every hook; compute the deferred statistics of the step."""
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
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
            if upcoming and self._kinds(upcoming) == self._kinds(armed):
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
        self._arm(upcoming)

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
                shadow_weight = self._shadow.weights.get(adapter.name)
                weight = adapter.weight
                if shadow_weight is not None and weight is not None:
                    adapter.record(KIND_DRIFT, comparison_stats(shadow_weight, weight, batch=self._deferred.batch))
        rows: list[Tensor] = []
        present: list[list[bool]] = []
        scales: list[Tensor] = []
        device, nan_row, with_scale = self._device, self._nan_row, "scale" in armed
        for adapter in adapters:
            taken = adapter.take()
            present.append([s is not None for s in taken])
            for stats in taken:
                # Few torch calls per layer: each costs several times its warm cost at the end of a step.
                row = nan_row if stats is None else stats.as_tensor()
                rows.append(row if row.device == device else row.to(device))
            scale = adapter.scale() if with_scale else None
            present[-1].append(scale is not None)
            scales.append(self._nan_scale if scale is None else scale if scale.device == device else scale.to(device))
        if scales:  # every layer's scale after every layer's sums: one float64 conversion for all of them
            rows.append(torch.stack(scales).to(torch.float64))

        host_scalars: dict[str, float] = {"step_seconds": step_seconds}
        if self._window_seconds > 0:
            host_scalars["agent_overhead_ratio"] = self._clock.seconds / self._window_seconds
        self._clock.seconds = 0.0
        self._window_seconds = 0.0
        tokens = tokens if tokens is not None else self._tokens_per_step
        if tokens is not None and step_seconds > 0:
            host_scalars["tokens_per_second"] = float(tokens) / step_seconds
        memory = (
            float(torch.cuda.memory_allocated(self._device))
            if self._device.type == "cuda"
            else _resident_memory_bytes()
        )
        if memory is not None:
            host_scalars["device_memory_bytes"] = memory
        if self._engine is not None:
            host_scalars.update({f"agent_{k}": float(v) for k, v in self._engine.exporter.counters().items()})
            host_scalars["agent_dropped_steps"] = float(self._engine.dropped_steps)
        host_scalars["agent_failures"] = float(self.failures.total())

        tensor_names: list[str] = []
        tensor_values: list[Tensor] = []
        if shadow_loss is not None:
            user_scalars = {**user_scalars, "loss_shadow": shadow_loss}
        for name, value in user_scalars.items():
            if not _SCALAR_NAME.fullmatch(name):
                self.failures.record("scalar_name", f"scalar name {name!r} is not valid; skipped")
            elif isinstance(value, Tensor) and value.numel() == 1:
                tensor_names.append(name)
                tensor_values.append(value.detach().reshape(1).to(device=self._device, dtype=torch.float64))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                host_scalars[name] = float(value)
            else:
                self.failures.record("scalar_value", f"scalar {name!r} must be a number or 1-element tensor")

        packed = torch.cat([*rows, *tensor_values]) if rows or tensor_values else torch.zeros(0, dtype=torch.float64)
        reader = _DeviceReader(packed)
        layers = tuple(a.name for a in adapters)
        wall_time = time.time()
        metric_names = [m for m in LAYER_METRICS if m in armed]

        def resolve() -> StepRecord:
            values = reader.read()
            n = len(layers)
            sums, scales = values[: n * _SUMS].reshape(n, _SUMS), values[n * _SUMS : n * _ROW]
            metrics = _derive(np.concatenate([sums, scales[:, None]], axis=1), present, metric_names)
            scalars = dict(host_scalars)
            scalars.update(zip(tensor_names, values[n * _ROW :].tolist(), strict=True))
            return StepRecord(step, wall_time, metrics, scalars)

        if self._engine is not None:
            self._engine.submit(PendingStep(layers, resolve))


class _DeviceReader:
    """Gets a packed statistics tensor to the host without blocking the training thread.

    On CUDA the copy goes to pinned memory with ``non_blocking=True`` and an event marks its end; the exporter thread
    waits on the event.  On CPU the tensor already is on the host."""

    def __init__(self, packed: Tensor) -> None:
        self._event: Any = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
            self._host = host
        else:
            self._host = packed.to("cpu")

    def read(self) -> np.ndarray:
        """The values as a float64 numpy array (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        values: np.ndarray = self._host.numpy()
        return values


def _derive(block: np.ndarray, present: list[list[bool]], metric_names: list[str]) -> dict[str, list[float | None]]:
    """Per-layer metric values from the packed partial sums (vectorised over layers and kinds)."""
    n = block.shape[0]
    sums = torch.from_numpy(np.ascontiguousarray(block[:, : _NK * _NF]).reshape(n, _NK, _NF))
    stats = ErrorStats(**{name: sums[..., i] for i, name in enumerate(_FIELDS)})
    mask = np.array(present, dtype=bool).reshape(n, _NK + 1)
    # A NaN count of elements marks statistics that were never filled (a tensor changed before they were computed).
    mask[:, :_NK] &= ~np.isnan(block[:, : _NK * _NF : _NF])
    # Comparisons of non-finite tensors have NaN sums, which the ratio formulas report as NaN (a signal).
    derived: dict[str, np.ndarray] = {
        "rel_l2": stats.rel_l2.numpy(),
        "cosine": stats.cosine.numpy(),
        "sqnr_db": stats.sqnr_db.numpy(),
        "underflow_ratio": stats.underflow_ratio.numpy(),
        "overflow_ratio": stats.overflow_ratio.numpy(),
        "amax": stats.amax.numpy(),
        "nonfinite_count": stats.nonfinite_count.numpy(),
    }
    sources: dict[str, tuple[str, int]] = {
        "weight_rel_l2": ("rel_l2", KIND_WEIGHT),
        "act_rel_l2": ("rel_l2", KIND_INPUT),
        "grad_rel_l2": ("rel_l2", KIND_GRAD),
        "output_rel_l2": ("rel_l2", KIND_OUTPUT),
        "output_cosine": ("cosine", KIND_OUTPUT),
        "output_sqnr_db": ("sqnr_db", KIND_OUTPUT),
        "update_cosine": ("cosine", KIND_UPDATE),
        "underflow_ratio": ("underflow_ratio", KIND_INPUT),
        "overflow_ratio": ("overflow_ratio", KIND_INPUT),
        "amax": ("amax", KIND_INPUT),
        "weight_drift_rel_l2": ("rel_l2", KIND_DRIFT),
    }
    out: dict[str, list[float | None]] = {}
    have: np.ndarray
    for metric in metric_names:
        if metric == "scale":
            values = block[:, _NK * _NF]
            have = mask[:, _NK]
        elif metric == "nonfinite_count":
            kinds = [KIND_WEIGHT, KIND_INPUT, KIND_GRAD]
            have = np.asarray(mask[:, kinds].any(axis=1))
            values = np.where(mask[:, kinds], derived["nonfinite_count"][:, kinds], 0.0).sum(axis=1)
        else:
            field, kind = sources[metric]
            values = derived[field][:, kind]
            have = mask[:, kind]
        if have.any():
            out[metric] = [float(v) if h else None for v, h in zip(values.tolist(), have.tolist(), strict=True)]
    return out


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
    tokens_per_step: float | None = None,
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
) -> Monitor:
    """Attach the agent to ``model`` and return its :class:`Monitor`.

    Monitored are the modules that implement the reference-forward protocol (``QuantLinear``, everything
    ``quantize_model`` made) and ``torch.ao`` QAT modules with fake quantizers, optionally narrowed by ``layers``
    (glob patterns on qualified names).  ``every``/``start``/``end`` set the sampling window (``end`` exclusive);
    ``metrics`` is a list of metric names or a mapping name → period.  Figures go to ``url`` (collector base URL, or
    ``file:///path.jsonl`` for a JSON-lines file; env ``QUANTWATCH_URL``, default ``http://127.0.0.1:8000``) or to a
    given ``exporter``.  ``rank`` defaults to ``torch.distributed``'s (or env ``RANK``); ``ranks`` picks which ranks
    report.  ``shadow="model"`` also trains an FP32 copy (optimizer from ``shadow_optimizer(params)``).

    Raises :class:`ConfigError` naming the field for configuration mistakes; nothing raises after this returns.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
    run = run or os.environ.get("QUANTWATCH_RUN")
    if not isinstance(run, str) or not RUN_NAME_PATTERN.fullmatch(run):
        raise ConfigError("run", f"must match {RUN_NAME_RULE}, got {run!r}")
    if shadow not in ("layer", "model"):
        raise ConfigError("shadow", f"must be 'layer' or 'model', got {shadow!r}")
    if shadow == "model" and shadow_optimizer is None:
        raise ConfigError("shadow_optimizer", "shadow='model' needs shadow_optimizer=lambda params: ...")
    if tokens_per_step is not None and (not isinstance(tokens_per_step, int | float) or tokens_per_step <= 0):
        raise ConfigError("tokens_per_step", f"must be a number > 0, got {tokens_per_step!r}")
    schedule = Schedule(_periods(metrics, every, shadow), start=start, end=end)
    modules = _find_layers(model, layers)
    if not modules:
        logger.warning("quantwatch agent: no quantized layer found in the model; only watched kernels will be measured")
    detected_rank = _detect_rank(rank)
    reporting = _reports(detected_rank, ranks)
    failures = FailureLog()
    engine = None
    shadow_model = None
    if reporting:
        if shadow == "model" and shadow_optimizer is not None:
            shadow_model = ShadowModel(model, modules, shadow_optimizer)
        chosen = _make_exporter(
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
        modules=modules if reporting else {},
        schedule=schedule,
        engine=engine,
        shadow=shadow_model,
        tokens_per_step=tokens_per_step,
        failures=failures,
    )
