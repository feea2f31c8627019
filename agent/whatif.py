"""What-if statistics: the error each monitored layer's weight, input and gradient would have under other formats.

On what-if steps (by default the first sampled step and then one every :data:`WHATIF_STEPS` steps; with
``whatif_every=N`` every N-th sampled step; 0: never) forward hooks on the monitored
modules quantize the tensors the layer saw (its master weight and the input of its first call in the step) and a
hook on that call's output the gradient that reaches it, to every candidate of :func:`layer_candidates` with the
fused kernels (``quantize(..., with_stats=True)``; stochastic rounding draws from a generator of the agent's own, so
training's random stream is untouched). The partial sums stay on the device until the step is taken; the exporter
thread derives ``rel_l2``, ``underflow_ratio`` and ``overflow_ratio`` (protocol ``WHATIF_FIELD``). Hooks are
installed for a what-if step only and removed when it is taken; failures are counted as ``whatif_failed``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from quantwatch.agent.failures import FailureLog
from quantwatch.agent.layers import OverheadClock
from quantwatch.agent.readout import DeviceReader
from quantwatch.agent.validation import check_whatif_every
from quantwatch.kernels import ErrorStats, quantize
from quantwatch.kernels.formats import accepted_format_names
from quantwatch.kernels.native import plain
from quantwatch.protocol import TENSOR_KINDS, WHATIF_CANDIDATES, WHATIF_STATS, candidate_spec, own_candidates

__all__ = ["WHATIF_STEPS", "WhatIf", "WhatIfValues", "layer_candidates"]

WHATIF_STEPS = 250
"""``whatif_every=None`` (the default): what-if statistics on the first sampled step and then on the first sampled step
at least 250 training steps after the previous what-if step (with ``every=25``: every 10th sampled step). On the CPU a
what-if step costs about 1.4 times a sampled step (+25-34 ms of CPU on the benchmark's 53-62 ms step, every candidate
on the native kernels, the stochastic-rounding ones included), so the agent adds 0.1-0.2% of a step for it whatever
the sampling: a period counted in sampled steps would cost 10% of every step at ``every=1`` (BENCHMARKS.md, issues 18
and 16)."""

SEED = 0x5EED_0F_5A
WhatIfValues = dict[str, dict[str, dict[str, list[float | None]]]]
"""``{kind: {candidate: {stat: values aligned with the step's layers (None: not measured)}}}``."""


def layer_candidates(formats: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Per tensor kind the candidates a layer of ``formats`` tries: the defaults and its own (see
    :func:`~quantwatch.protocol.formats.own_candidates`), those the kernels can quantize to (a layer an adapter
    reports in ``bf16`` adds none)."""
    quantizable = set(accepted_format_names())
    out: dict[str, tuple[str, ...]] = {}
    for kind in TENSOR_KINDS:
        own = formats.get(kind, "unknown")
        names = [*WHATIF_CANDIDATES, *(own_candidates(kind, own) if own != "unknown" else ())]
        kept = []
        for name in dict.fromkeys(names):
            try:
                fmt, _, _ = candidate_spec(name)
            except ValueError:
                continue
            if fmt in quantizable:
                kept.append(name)
        out[kind] = tuple(kept)
    return out


class _Layer:
    """One module's hooks and this step's statistics by (kind, candidate)."""

    def __init__(self, name: str, module: nn.Module, candidates: dict[str, tuple[str, ...]]) -> None:
        self.name = name
        self.module = module
        self.candidates = candidates
        self.stats: dict[tuple[str, str], ErrorStats] = {}
        self.seen = False
        self.handle: RemovableHandle | None = None


class WhatIf:
    """The what-if statistics of the modules a monitor measures (``found``: qualified name → object with ``.module``
    and ``.formats``; ``measured``: the names of those its adapters measure, not those left out)."""

    def __init__(
        self,
        every: int | None,
        found: Mapping[str, Any],
        measured: Iterable[str],
        failures: FailureLog,
        clock: OverheadClock,
    ) -> None:
        self.every = check_whatif_every(every)
        self._last_step: int | None = None  # the latest what-if step (whatif_every=None)
        self.failures = failures
        self.clock = clock
        names = set(map(str, measured))
        self._layers = [
            _Layer(name, item.module, layer_candidates(item.formats))
            for name, item in found.items()
            if name in names and isinstance(getattr(item, "module", None), nn.Module)
        ]
        self._generators: dict[torch.device, torch.Generator] = {}
        self._armed = False

    def arm(self, sampled_index: int, step: int) -> None:
        """Hook the modules when the sampled step numbered ``sampled_index`` (from 0), training step ``step``, is a
        what-if step."""
        if not self._due(sampled_index, step):
            return
        self._last_step = step
        self._armed = True
        for layer in self._layers:
            if layer.handle is None:
                layer.handle = layer.module.register_forward_hook(functools.partial(self._on_forward, layer))

    def _due(self, sampled_index: int, step: int) -> bool:
        """Whether that sampled step is a what-if step (see :data:`WHATIF_STEPS`)."""
        if self.every is not None:
            return bool(self.every) and sampled_index % self.every == 0
        return self._last_step is None or step >= self._last_step + WHATIF_STEPS

    def disarm(self) -> None:
        """Remove the hooks (the statistics stay until :meth:`take`)."""
        for layer in self._layers:
            if layer.handle is not None:
                layer.handle.remove()
                layer.handle = None

    def take(self, layers: tuple[str, ...]) -> Callable[[], WhatIfValues] | None:
        """This step's statistics as a function that derives them (on the exporter thread) aligned with ``layers``;
        None when the step was no what-if step. Removes the hooks."""
        if not self._armed:
            return None
        self._armed = False
        self.disarm()
        entries: list[tuple[int, str, str]] = []
        rows: list[Tensor] = []
        position = {name: i for i, name in enumerate(layers)}
        with self.clock.measure():
            for layer in self._layers:
                stats, layer.stats, layer.seen = layer.stats, {}, False
                index = position.get(layer.name)
                if index is None:
                    continue
                for (kind, candidate), part in stats.items():
                    try:
                        row = part.as_tensor()
                    except Exception as exc:
                        self.failures.record("whatif_failed", f"{layer.name}: what-if statistics: {exc}", exc)
                        continue
                    entries.append((index, kind, candidate))
                    rows.append(row)
            if not rows:
                return None
            device = rows[0].device
            reader = DeviceReader(torch.stack([r if r.device == device else r.to(device) for r in rows]))
        count = len(layers)

        def resolve() -> WhatIfValues:
            sums = torch.from_numpy(np.ascontiguousarray(reader.read()))
            stats = ErrorStats(**{name: sums[:, i] for i, name in enumerate(ErrorStats.FIELDS)})
            derived = {name: getattr(stats, name).tolist() for name in WHATIF_STATS}
            out: WhatIfValues = {}
            for row, (index, kind, candidate) in enumerate(entries):
                per_stat = out.setdefault(kind, {}).setdefault(candidate, {})
                for name in WHATIF_STATS:
                    per_stat.setdefault(name, [None] * count)[index] = float(derived[name][row])
            return out

        return resolve

    # ------------------------------------------------------------------------------------------------- hooks
    def _on_forward(self, layer: _Layer, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if layer.seen:
            return
        layer.seen = True
        with self.clock.measure():
            try:
                weight = getattr(module, "weight", None)
                if isinstance(weight, Tensor) and weight.is_floating_point():
                    self._measure(layer, "weight", weight)
                x = args[0] if args and isinstance(args[0], Tensor) else None
                if x is not None and x.is_floating_point():
                    self._measure(layer, "input", x)
                if isinstance(output, Tensor) and output.requires_grad:
                    output.register_hook(functools.partial(self._on_grad, layer))  # type: ignore[no-untyped-call]
            except Exception as exc:
                self.failures.record("whatif_failed", f"{layer.name}: what-if statistics: {exc}", exc)

    def _on_grad(self, layer: _Layer, grad: Tensor) -> None:
        with self.clock.measure():
            try:
                self._measure(layer, "grad", grad)
            except Exception as exc:
                self.failures.record("whatif_failed", f"{layer.name}: what-if statistics: {exc}", exc)

    def _measure(self, layer: _Layer, kind: str, tensor: Tensor) -> None:
        x = tensor.detach()
        if not plain(x):
            return  # a subclass (FSDP2's sharded DTensor weight, a torchao wrapper): its values are not all here
        with torch.no_grad():
            for candidate in layer.candidates[kind]:
                fmt, scaling, rounding = candidate_spec(candidate)
                generator = self._generator(x.device) if rounding == "stochastic" else None
                _, stats = quantize(x, fmt, scaling, rounding, generator=generator, with_stats=True)
                layer.stats[(kind, candidate)] = stats

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(SEED)
            self._generators[device] = generator
        return generator
