"""The closed loop: the run's firing alerts back into the training job, and the ready actions (``qw.actions``).

```python
import quantwatch.agent as qw
monitor = qw.attach(model, run="gpt-fp4", url=URL)
monitor.on_alert(lambda alert: qw.actions.keep_high_precision([alert.layer], format="fp8"))
for step, batch in enumerate(loader):
    ...; monitor.step(step, loss=loss)
    if monitor.should_stop:
        break
```

**How alerts arrive.** The collector's ingest answer lists the run's firing episodes (protocol
``FIRING_EPISODES_FIELD``; absent when none fires), so the agent learns them with no request of its own. The exporter
thread leaves the latest list in an :class:`AlertInbox`; :meth:`ActionLoop.boundary`, called by ``monitor.step`` on
the training thread, hands each episode it has not delivered yet to the ``on_alert`` callbacks, once. Nothing runs
mid-step: a callback, and any action, only ever runs inside ``monitor.step``, between two optimizer steps. A callback
that raises is logged and counted (``monitor.stats()["failures"]["alert_callback"]``), never raised into training.

**Actions** are requests: :func:`keep_high_precision`, :func:`save_shadow_checkpoint` and :func:`stop_training`
queue one for the monitor (the one whose callback is running, else the newest open one, else the one given), and it is
applied at a step boundary. Each applied action is recorded as a protocol :class:`~quantwatch.protocol.Action` with
the step it was taken after, and sent to the collector in the batch field ``actions`` (with the layer formats as they
are from then on).

**Distributed training.** Under ``torch.distributed`` with more than one rank, an action must change every replica at
the same step, or the replicas diverge. Ranks learn alerts at different times (each from its own ingest answers; a
rank that does not report learns none), so requests are agreed at fixed steps instead: at every step that is a
multiple of the monitor's smallest sampling period (``every``, the same on every rank), every rank takes part in one
``all_reduce(MAX)`` of its count of pending requests, on a gloo group over the CPU (no device synchronisation; the
default group when it is gloo already). When the maximum is 0 — nearly always — that is all. Otherwise the ranks
``all_gather_object`` their requests and each applies the same union, in rank order, at that same step. The steps in
between cost nothing: a rank does not look at its requests there. An action therefore takes effect up to ``every``
steps after its alert reached the first rank; a checkpoint is written by rank 0 only.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from quantwatch.agent.adapters.discovery import adapter_for, layer_formats, layer_patterns, matches
from quantwatch.agent.adapters.registry import LayerInfo
from quantwatch.agent.engine import PendingStep
from quantwatch.agent.errors import ConfigError
from quantwatch.agent.precision import check_format, switch_precision, switchable
from quantwatch.agent.readout import metric_kinds
from quantwatch.agent.shadow import ShadowOptions
from quantwatch.agent.wire import StepRecord, wire_formats
from quantwatch.agent.wrappers import named_modules, unwrap
from quantwatch.protocol import FIRING_EPISODE_KEYS, Action

if TYPE_CHECKING:
    from quantwatch.agent.monitor import Monitor

__all__ = [
    "ActionLoop",
    "Alert",
    "AlertInbox",
    "keep_high_precision",
    "save_shadow_checkpoint",
    "stop_training",
]

logger = logging.getLogger("quantwatch.agent")

AlertCallback = Callable[["Alert"], object]


@dataclass(frozen=True)
class Alert:
    """A firing alert episode of the run, as ``monitor.on_alert`` callbacks get it."""

    episode: int
    rule: str
    layer: str
    ranks: tuple[int, ...]
    since_step: int | None
    severity: str

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> Alert:
        """From one entry of the ingest answer's ``firing_episodes``."""
        episode, rule, layer, ranks, since, severity = (raw.get(key) for key in FIRING_EPISODE_KEYS)
        return cls(int(episode), str(rule), str(layer or ""), tuple(int(r) for r in ranks or ()),  # type: ignore[arg-type]
                   None if since is None else int(since), str(severity or ""))  # fmt: skip


class AlertInbox:
    """The run's firing alerts as the latest ingest answer listed them: written by the exporter thread, read by the
    training thread (one tuple, replaced whole)."""

    def __init__(self) -> None:
        self.firing: tuple[Alert, ...] = ()

    def receive(self, episodes: Iterable[dict[str, Any]] | None) -> None:
        """An ingest answer's ``firing_episodes`` (None: the field was absent, nothing fires)."""
        if not episodes:
            if self.firing:
                self.firing = ()
            return
        self.firing = tuple(Alert.from_wire(raw) for raw in episodes)


@dataclass(frozen=True)
class Request:
    """A queued action: what to do, and the alert episode it answers (None: not from a callback)."""

    action: str
    layers: tuple[str, ...] = ()
    format: str | None = None
    path: str | None = None
    episode: int | None = None

    def key(self) -> tuple[Any, ...]:
        """What makes two requests the same action (whichever alert asked)."""
        return (self.action, self.layers, self.format, self.path)


_CURRENT: contextvars.ContextVar[tuple[ActionLoop, Alert] | None] = contextvars.ContextVar("qw_alert", default=None)
_LOOPS: list[weakref.ReferenceType[ActionLoop]] = []


class ActionLoop:
    """A monitor's callbacks, pending requests and the step-boundary work (see the module doc)."""

    def __init__(self, monitor: Monitor, cadence: int, exporter: object | None) -> None:
        self.inbox = AlertInbox()
        self.should_stop = False
        self.cadence = cadence
        self._monitor = weakref.ref(monitor)
        self._callbacks: list[AlertCallback] = []
        self._delivered: set[int] = set()
        self._pending: list[Request] = []
        self._group: Any = None
        if hasattr(exporter, "on_answer"):
            exporter.on_answer = self.inbox.receive
        _LOOPS[:] = [ref for ref in _LOOPS if ref() is not None] + [weakref.ref(self)]

    def on_alert(self, callback: AlertCallback) -> None:
        """Register ``callback(alert)``; ConfigError when it is not callable."""
        if not callable(callback):
            raise ConfigError("callback", f"must be callable, got {type(callback).__name__}")
        self._callbacks.append(callback)

    def request(self, request: Request) -> None:
        """Queue ``request`` for the next step boundary (the next agreed one in distributed training)."""
        self._pending.append(request)

    def boundary(self, step: int) -> None:
        """The end of step ``step``, on the training thread: deliver new alerts, then apply the agreed requests."""
        if self.inbox.firing and self._callbacks:
            self._deliver(step)
        requests = self._agreed(step)
        if requests:
            self._apply(step, requests)

    def _deliver(self, step: int) -> None:
        monitor = self._monitor()
        for alert in self.inbox.firing:
            if alert.episode in self._delivered:
                continue
            self._delivered.add(alert.episode)
            for callback in self._callbacks:
                token = _CURRENT.set((self, alert))
                try:
                    callback(alert)
                except Exception as exc:
                    if monitor is not None:
                        monitor.failures.record("alert_callback", f"an on_alert callback failed at step {step}", exc)
                finally:
                    _CURRENT.reset(token)

    def _agreed(self, step: int) -> list[Request]:
        """The requests to apply at this boundary: all pending ones alone, the ranks' union at an agreement step."""
        if step % self.cadence and not self._pending:
            return []  # the common case, decided without asking torch.distributed
        if not _distributed():
            pending, self._pending = self._pending, []
            return pending
        if step % self.cadence:
            return []
        group = self._agreement_group()
        count = torch.tensor([len(self._pending)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        if not int(count.item()):
            return []
        gathered: list[list[Request] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self._pending, group=group)
        self._pending = []
        union: dict[tuple[Any, ...], Request] = {}
        for requests in gathered:
            for request in requests or ():
                union.setdefault(request.key(), request)
        return list(union.values())

    def _agreement_group(self) -> Any:
        """A gloo group of every rank (created once, at the first agreement step, which every rank reaches)."""
        if dist.get_backend() == "gloo":
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _apply(self, step: int, requests: list[Request]) -> None:
        monitor = self._monitor()
        if monitor is None:
            return
        taken: list[Action] = []
        for request in requests:
            try:
                taken.extend(_APPLY[request.action](self, monitor, step, request))
            except Exception as exc:
                kind = f"action_{request.action}"
                monitor.failures.record(kind, f"{request.action} failed at step {step}: {exc}", exc)
        if taken:
            _record(monitor, step, taken)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _keep(loop: ActionLoop, monitor: Monitor, step: int, request: Request) -> list[Action]:
    matched = [
        (name, module) for name, module in named_modules(monitor._model) if name and matches(name, request.layers)
    ]
    layers = [(name, module) for name, module in matched if switchable(module)]
    if not layers:
        which = "no layer it can switch" if matched else "no layer"
        monitor.failures.record("action_layers", f"keep_high_precision: {which} matches {list(request.layers)}")
    taken = []
    for name, module in layers:
        before = layer_formats(name, module) or {}
        try:
            switch_precision(module, request.format)
        except Exception as exc:  # that layer stays as it was; the others are switched
            what = f"layer {name!r} ({type(module).__name__}) not switched to format={request.format!r}"
            monitor.failures.record("action_keep_high_precision", f"keep_high_precision: {what} at step {step}: {exc}")
            continue
        after = layer_formats(name, module) or {}
        changes = [f"{kind} {before.get(kind)} → {after[kind]}" for kind in after if after[kind] != before.get(kind)]
        if changes:
            taken.append(Action(step, "keep_high_precision", name, "; ".join(changes), request.episode))
    return taken


def _checkpoint(loop: ActionLoop, monitor: Monitor, step: int, request: Request) -> list[Action]:
    if _distributed() and dist.get_rank() != 0:
        return []  # the replicas hold the same weights: rank 0 writes them
    path = str(request.path)
    if monitor._shadow is not None:
        monitor._shadow.save(path)
        what = "the FP32 shadow model's weights (shadow='model')"
    else:
        state = unwrap(monitor._model).state_dict()
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()})
        torch.save(state, path)
        what = f"the model's master weights ({', '.join(dtypes) or 'no floating-point'}; no shadow model)"
    logger.info("quantwatch agent: saved %s to %s after step %d", what, path, step)
    return [Action(step, "save_shadow_checkpoint", "", f"{what} → {path}", request.episode)]


def _stop(loop: ActionLoop, monitor: Monitor, step: int, request: Request) -> list[Action]:
    if loop.should_stop:
        return []
    loop.should_stop = True
    return [Action(step, "stop_training", "", "training asked to stop after this step", request.episode)]


_APPLY: dict[str, Callable[[ActionLoop, Monitor, int, Request], list[Action]]] = {
    "keep_high_precision": _keep,
    "save_shadow_checkpoint": _checkpoint,
    "stop_training": _stop,
}


def _record(monitor: Monitor, step: int, taken: list[Action]) -> None:
    """The layers' formats and measurers from now on, and the actions to the collector with the next batch."""
    changed = {a.layer for a in taken if a.layer}
    modules = dict(named_modules(monitor._model)) if changed else {}
    with monitor._lock:
        for index, info in enumerate(monitor._infos):
            if info.name in changed:
                _remeasure(monitor, index, info, modules[info.name])
        monitor._wire_layers = monitor._layers_on_the_wire()
    engine = monitor._engine
    if engine is not None and monitor.reporting:
        layers, formats_on_wire = monitor._wire_layers
        record = StepRecord(step, time.time())
        engine.submit(PendingStep(layers, lambda: record, formats_on_wire, tuple(taken)))


def _remeasure(monitor: Monitor, index: int, info: LayerInfo, module: torch.nn.Module) -> None:
    """A switched layer's new formats, and a new measurer from the adapter recognising it now (its casts are not the
    ones the old measurer recomputes), armed as the old one was."""
    adapter = adapter_for(module)
    if adapter is None:
        return
    try:
        measurer = adapter.create(info.name, module, monitor._context)
    except Exception as exc:
        monitor.failures.record("action_remeasure", f"{info.name}: no measurer for its new formats: {exc}", exc)
        return
    old = monitor._adapters[index]
    measurer.configure(getattr(old, "options", ShadowOptions()), index)
    if monitor._armed:
        old.disarm()
        measurer.arm(metric_kinds(monitor._armed))
    monitor._adapters[index] = measurer
    formats = layer_formats(info.name, module) or dict(info.formats)
    monitor._infos[index] = LayerInfo(info.name, adapter.name, formats)
    monitor._wire_formats[info.name] = wire_formats(info.name, formats)


def _loop_for(monitor: Monitor | None) -> ActionLoop:
    if monitor is not None:
        return monitor._loop
    current = _CURRENT.get()
    if current is not None:
        return current[0]
    for ref in reversed(_LOOPS):
        loop = ref()
        owner = loop._monitor() if loop is not None else None
        if loop is not None and owner is not None and not owner._closed:
            return loop
    raise ConfigError("monitor", "no open monitor: call qw.attach(...) first, or pass monitor=")


def _episode() -> int | None:
    current = _CURRENT.get()
    return current[1].episode if current is not None else None


def keep_high_precision(
    layers: str | Iterable[str], format: str | None = None, *, monitor: Monitor | None = None
) -> None:
    """Switch the quantization of ``layers`` (qualified names or glob patterns, as ``attach(layers=...)``) off, or to
    ``format`` (``"fp8"``: E4M3 forward, E5M2 gradients; a torchao float8 recipe ``"fp8:rowwise"``, ...; a QuantWatch
    format or preset name), at the next step boundary (see the module doc), in place, for every layer kind an adapter
    measures; which kind takes which format: :mod:`quantwatch.agent.precision`. Raises ConfigError for an invalid
    ``layers`` or ``format``; a format a matched layer cannot take is recorded in ``monitor.failures``."""
    names = layer_patterns(layers)
    check_format(format)
    _loop_for(monitor).request(Request("keep_high_precision", names, format, episode=_episode()))


def save_shadow_checkpoint(path: str | os.PathLike[str], *, monitor: Monitor | None = None) -> None:
    """Write the FP32 point to roll back to, at the next step boundary: the shadow model's weights with
    ``attach(shadow="model")``, else the model's master weights (the recorded action says which)."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ConfigError("path", f"must be a file path, got {path!r}")
    _loop_for(monitor).request(Request("save_shadow_checkpoint", path=os.fspath(path), episode=_episode()))


def stop_training(*, monitor: Monitor | None = None) -> None:
    """Ask the training to stop at the next step boundary: ``monitor.should_stop`` turns true (the HF and Lightning
    callbacks stop their trainer; a plain loop checks it)."""
    _loop_for(monitor).request(Request("stop_training", episode=_episode()))
