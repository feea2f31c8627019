"""Fingerprints of each layer's master weights on sampled steps, for the collector's cross-rank comparison.

Ranks of one data-parallel replica group must hold bit-identical master weights after every optimizer step; the
collector compares what they send (``rank_weight_mismatch``).  A fingerprint is cheap and computed on the device
where the weight lives, at the end of the step (after ``optimizer.step()``): float64 ``Σw`` and ``Σw²`` (they
estimate how far two ranks are apart) and a checksum of the bits (it says whether they are apart at all): the
integer view of the elements summed, and summed again weighted by row number, both modulo 2⁶⁴ — any single changed
bit changes the first, moved rows change the second.  The values are read on the exporter thread.

A :class:`RankReporter` also carries the rank's environment, sent once with the first step it reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from quantwatch.agent.adapters import Found
from quantwatch.agent.engine import BatchEngine, PendingStep
from quantwatch.agent.environment import environment, replica_group
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.sampling import Schedule
from quantwatch.agent.wire import Fingerprints, StepRecord

__all__ = ["RankReporter", "weight_fingerprint"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = (1 << 64) - 1

RankExtras = Callable[[], tuple[Fingerprints | None, Mapping[str, str] | None]]


def weight_fingerprint(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(float64 [Σw, Σw²], int64 [Σ words, Σ (row+1)·Σ words of the row])`` of ``weight`` on its device (no sync).

    The checksum sums the bytes as 64-bit words (the elements' own width when a row is not a whole number of words),
    wrapping modulo 2⁶⁴: exact and independent of the order of addition, so ranks that add in another order still
    agree. The sums accumulate per row in the weight's dtype and across rows in float64: estimates of how far two
    ranks are apart, never compared for identity. A DTensor is fingerprinted by its local shard."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    w = local.detach()
    rows = w.reshape(w.shape[0] if w.dim() > 1 else 1, -1)
    values = rows
    if rows.is_complex():
        values = torch.view_as_real(rows).flatten(1)
    elif not rows.is_floating_point():
        values = rows.double()
    # Row sums in float32 at least (bfloat16 ones would carry 3 digits); asking float32 of float32 costs a slow path.
    wide = None if values.dtype in (torch.float32, torch.float64) else torch.float32
    sums = torch.stack(
        [
            values.sum(dim=1, dtype=wide).double().sum(),
            torch.linalg.vector_norm(values, dim=1, dtype=wide).double().square().sum(),
        ]
    )
    words = rows.contiguous()
    if (words.shape[1] * words.element_size()) % 8 == 0:
        words = words.view(torch.int64)
    else:
        words = words.view(_BITS[words.element_size()])
    row_words = words.sum(dim=1, dtype=torch.int64)
    position = torch.arange(1, row_words.numel() + 1, dtype=torch.int64, device=row_words.device)
    return sums, torch.stack([row_words.sum(), (row_words * position).sum()])


def _checksum_hex(first: int, second: int) -> str:
    return f"{first & _MASK:016x}{second & _MASK:016x}"


class RankReporter:
    """What every rank sends beyond its metrics: weight fingerprints on sampled steps (when its replica group has
    more than one rank) and, once, its environment."""

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        group: tuple[int, ...],
        environment: Mapping[str, str],
        schedule: Schedule,
        failures: FailureLog | None = None,
    ) -> None:
        self.group = group
        self.schedule = schedule
        self.failures = failures or FailureLog()
        self._modules = dict(modules)
        self._environment: Mapping[str, str] | None = dict(environment)

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        found: Mapping[str, Found],
        rank: int,
        group: Iterable[int] | None,
        schedule: Schedule,
        failures: FailureLog,
    ) -> RankReporter:
        """The reporter of ``attach()``: the found layers, the replica group (``group`` overrides the detected one)
        and the environment of the model's device. Raises ConfigError."""
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        modules = {name: entry.module for name, entry in found.items()}
        return cls(modules, replica_group(model, rank, group), environment(device), schedule, failures)

    @property
    def fingerprints(self) -> bool:
        """Whether fingerprints are taken: there is another rank to compare with."""
        return len(self.group) > 1

    def capture(self, names: Sequence[str]) -> RankExtras:
        """Fingerprint the weights of ``names`` now (device work only); the returned callable reads them (on the
        exporter thread) as the step record's ``fingerprints`` and ``environment``."""
        environment, self._environment = self._environment, None
        if not self.fingerprints:
            return lambda: (None, environment)
        present: list[int] = []
        sums: list[Tensor] = []
        checks: list[Tensor] = []
        for index, name in enumerate(names):
            weight = getattr(self._modules.get(name), "weight", None)
            if isinstance(weight, Tensor) and weight.numel() > 0:
                try:
                    s, c = weight_fingerprint(weight)
                except Exception as exc:  # a weight type that has no plain bits (a training wrapper subclass)
                    self.failures.record("fingerprint", f"{name}: cannot fingerprint its weight: {exc}", exc)
                    continue
                present.append(index)
                sums.append(s if not sums or s.device == sums[0].device else s.to(sums[0].device))
                checks.append(c if not checks or c.device == checks[0].device else c.to(checks[0].device))
        n, group = len(names), self.group
        # Stacked on the device now (no sync on the training thread); read on the exporter thread.
        sum_table = torch.stack(sums) if sums else None
        check_table = torch.stack(checks) if checks else None

        def read() -> tuple[Fingerprints | None, Mapping[str, str] | None]:
            total: list[float | None] = [None] * n
            square: list[float | None] = [None] * n
            hashes: list[str | None] = [None] * n
            if sum_table is not None and check_table is not None:
                sum_rows, check_rows = sum_table.tolist(), check_table.tolist()
                for index, (s, q), (a, b) in zip(present, sum_rows, check_rows, strict=True):
                    total[index], square[index], hashes[index] = s, q, _checksum_hex(a, b)
            return Fingerprints(group, tuple(total), tuple(square), tuple(hashes)), environment

        return read

    def submit_alone(self, engine: BatchEngine, step: int) -> None:
        """For a rank that does not report its figures: on a sampled ``step``, queue a record with only the
        fingerprints (and the environment once)."""
        if not self.schedule.metrics_at(step) or (not self.fingerprints and self._environment is None):
            return
        names, wall_time = tuple(self._modules), time.time()
        extras = self.capture(names)

        def resolve() -> StepRecord:
            fingerprints, environment = extras()
            return StepRecord(step, wall_time, fingerprints=fingerprints, environment=environment)

        engine.submit(PendingStep(names, resolve))
