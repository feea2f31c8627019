"""Which metrics are measured at which step, and the cheap gate that answers "what is the next step that needs work?"

A metric with period ``p`` is measured at steps ``start, start + p, start + 2p, …`` below ``end`` (``end`` exclusive,
``None`` = no end).  The monitor asks :meth:`Schedule.next_step` once per sampled step and then only compares
integers until that step comes (TransformerEngine debug style), so unsampled steps do no schedule work at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from quantwatch.agent.errors import ConfigError
from quantwatch.protocol import AGENT_METRICS, LAYER_METRICS

__all__ = ["LAYER_METRICS", "Schedule"]


@dataclass(frozen=True)
class Schedule:
    """Per-metric periods inside one step window ``[start, end)``."""

    periods: Mapping[str, int]
    start: int = 0
    end: int | None = None
    _distinct: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.periods:
            raise ConfigError("metrics", "at least one metric must be enabled")
        for name, period in self.periods.items():
            if name not in AGENT_METRICS:
                raise ConfigError("metrics", f"unknown metric {name!r}; known: {', '.join(AGENT_METRICS)}")
            if not isinstance(period, int) or isinstance(period, bool) or period < 1:
                raise ConfigError("every", f"the period of {name!r} must be an integer >= 1, got {period!r}")
        if not isinstance(self.start, int) or self.start < 0:
            raise ConfigError("start", f"must be an integer >= 0, got {self.start!r}")
        if self.end is not None and (not isinstance(self.end, int) or self.end <= self.start):
            raise ConfigError("end", f"must be an integer > start ({self.start}), got {self.end!r}")
        object.__setattr__(self, "_distinct", tuple(sorted(set(self.periods.values()))))

    def metrics_at(self, step: int) -> frozenset[str]:
        """The metrics measured at ``step`` (empty when the step is not sampled)."""
        if step < self.start or (self.end is not None and step >= self.end):
            return frozenset()
        offset = step - self.start
        return frozenset(name for name, period in self.periods.items() if offset % period == 0)

    def next_step(self, step: int) -> int | None:
        """The first step ``>= step`` at which some metric is measured; None when the window is over."""
        first = max(step, self.start)
        offset = first - self.start
        candidate = min(self.start + -(-offset // period) * period for period in self._distinct)
        if self.end is not None and candidate >= self.end:
            return None
        return candidate
