"""Run scalars of a step (``loss=``, ``lr=``, ...): checked and split into host numbers and device tensors on the
training thread, read on the exporter thread; and the records of steps that carry scalars only.

Scalars are sent for every step they are given on (``attach(scalars_every=N)`` for every N-th), whatever the layer
sampling: they are a few numbers, and they travel in the batches the sampled steps fill anyway.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from quantwatch.agent.engine import BatchEngine
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.readout import DeviceReader
from quantwatch.agent.wire import StepRecord

__all__ = ["agent_scalars", "resident_memory_bytes", "scalar_step", "split_scalars"]

SCALAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,199}")


def split_scalars(
    values: Mapping[str, Any], device: torch.device, failures: FailureLog
) -> tuple[dict[str, float], list[str], list[Tensor]]:
    """``(numbers, names of tensors, the tensors as float64 on device)``; invalid names and values are counted in
    ``failures`` and left out."""
    numbers: dict[str, float] = {}
    names: list[str] = []
    tensors: list[Tensor] = []
    for name, value in values.items():
        if not SCALAR_NAME.fullmatch(name):
            failures.record("scalar_name", f"scalar name {name!r} is not valid; skipped")
        elif isinstance(value, Tensor) and value.numel() == 1:
            names.append(name)
            tensors.append(value.detach().reshape(1).to(device=device, dtype=torch.float64))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
        else:
            failures.record("scalar_value", f"scalar {name!r} must be a number or 1-element tensor")
    return numbers, names, tensors


def scalar_step(
    step: int, numbers: dict[str, float], names: list[str], tensors: list[Tensor]
) -> Callable[[], StepRecord]:
    """The record of a step that carries scalars only, resolved on the exporter thread (a device tensor's value is
    copied there, never waited for on the training thread)."""
    wall_time = time.time()
    reader = DeviceReader(torch.cat(tensors)) if tensors else None

    def resolve() -> StepRecord:
        scalars = dict(numbers)
        if reader is not None:
            scalars.update(zip(names, reader.read().tolist(), strict=True))
        return StepRecord(step, wall_time, {}, scalars)

    return resolve


def agent_scalars(
    step_seconds: float,
    overhead_ratio: float | None,
    tokens: float | None,
    device: torch.device,
    engine: BatchEngine | None,
    failures: FailureLog,
) -> dict[str, float]:
    """The scalars a sampled step reports about itself and the agent: step time, the agent's overhead ratio over the
    window since the previous sampled step, throughput, memory, the exporter's counters and the failures."""
    scalars: dict[str, float] = {"step_seconds": step_seconds}
    if overhead_ratio is not None:
        scalars["agent_overhead_ratio"] = overhead_ratio
    if tokens is not None and step_seconds > 0:
        scalars["tokens_per_second"] = float(tokens) / step_seconds
    memory = float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else resident_memory_bytes()
    if memory is not None:
        scalars["device_memory_bytes"] = memory
    if engine is not None:
        scalars.update({f"agent_{k}": float(v) for k, v in engine.exporter.counters().items()})
        scalars["agent_dropped_steps"] = float(engine.dropped_steps)
    scalars["agent_failures"] = float(failures.total())
    return scalars


class _Statm:
    """``/proc/self/statm`` kept open and read with ``pread`` (opening it costs several times the read, every sampled
    step); a forked child opens its own, the parent's descriptor would read the parent's memory."""

    fd: int | None = None
    page_size = 0

    @classmethod
    def resident_bytes(cls) -> float:
        if cls.fd is None:
            cls.page_size = os.sysconf("SC_PAGE_SIZE")
            cls.fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        return float(int(os.pread(cls.fd, 256, 0).split()[1]) * cls.page_size)

    @classmethod
    def forget(cls) -> None:
        if cls.fd is not None:
            os.close(cls.fd)
            cls.fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Statm.forget)


def resident_memory_bytes() -> float | None:
    """The process's resident memory (the CPU's stand-in for device memory), or None where /proc cannot tell."""
    try:
        return _Statm.resident_bytes()
    except (OSError, ValueError, IndexError, AttributeError):
        return None
