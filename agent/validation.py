"""The checks of :func:`~quantwatch.agent.attach`'s options that need no model: sampling periods, ranks."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from quantwatch.agent.errors import ConfigError
from quantwatch.agent.readout import METRIC_KINDS
from quantwatch.protocol import LAYER_METRICS, RUN_NAME_PATTERN, RUN_NAME_RULE

__all__ = [
    "DEFAULT_METRICS",
    "check_run",
    "check_scalars_every",
    "check_shadow",
    "check_step_options",
    "check_whatif_every",
    "detect_rank",
    "periods",
    "reports",
]

#: Measured by default (the catalogued metrics this agent measures); ``weight_drift_rel_l2`` joins them with
#: ``shadow="model"``.
DEFAULT_METRICS: tuple[str, ...] = tuple(m for m in LAYER_METRICS if m != "weight_drift_rel_l2" and m in METRIC_KINDS)


def detect_rank(rank: int | None) -> int:
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


def reports(rank: int, ranks: str | Iterable[int]) -> bool:
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


def periods(metrics: Sequence[str] | Mapping[str, int] | None, every: int, shadow: str) -> dict[str, int]:
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
        if name not in METRIC_KINDS:
            raise ConfigError("metrics", f"{name!r} is catalogued but not measured by this agent yet")
    if "weight_drift_rel_l2" in periods and shadow != "model":
        raise ConfigError("metrics", "weight_drift_rel_l2 needs shadow='model'")
    return periods


def check_run(run: object) -> str:
    """``run`` if it is a valid run name, else ConfigError."""
    if not isinstance(run, str) or not RUN_NAME_PATTERN.fullmatch(run):
        raise ConfigError("run", f"must match {RUN_NAME_RULE}, got {run!r}")
    return run


def check_shadow(shadow: object) -> None:
    """ConfigError unless ``shadow`` is ``"layer"`` or ``"model"``."""
    if shadow not in ("layer", "model"):
        raise ConfigError("shadow", f"must be 'layer' or 'model', got {shadow!r}")


def check_scalars_every(scalars_every: object) -> None:
    """ConfigError unless ``scalars_every`` is an integer >= 1."""
    if not isinstance(scalars_every, int) or isinstance(scalars_every, bool) or scalars_every < 1:
        raise ConfigError("scalars_every", f"must be an integer >= 1, got {scalars_every!r}")


def check_whatif_every(whatif_every: object) -> int | None:
    """``whatif_every`` if it is None (the default period in training steps) or an integer >= 0 (0: no what-if
    statistics), else ConfigError."""
    if whatif_every is None:
        return None
    if not isinstance(whatif_every, int) or isinstance(whatif_every, bool) or whatif_every < 0:
        raise ConfigError(
            "whatif_every", f"must be None or an integer >= 0 (0: no what-if statistics), got {whatif_every!r}"
        )
    return whatif_every


def check_step_options(tokens_per_step: object, scalars_every: object, whatif_every: object) -> None:
    """ConfigError naming the first of ``tokens_per_step`` (None or a number > 0), ``scalars_every`` and
    ``whatif_every`` that is wrong."""
    if tokens_per_step is not None and (
        not isinstance(tokens_per_step, int | float) or isinstance(tokens_per_step, bool) or tokens_per_step <= 0
    ):
        raise ConfigError("tokens_per_step", f"must be a number > 0, got {tokens_per_step!r}")
    check_scalars_every(scalars_every)
    check_whatif_every(whatif_every)
