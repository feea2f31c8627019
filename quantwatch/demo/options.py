"""What the demo is asked for (:class:`DemoOptions`) and what it produced (:class:`DemoResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantwatch.demo.recipes import RECIPES
from quantwatch.demo.webhooks import Notification

DEFAULT_STEPS = 80
DEFAULT_DATABASE = Path("quantwatch-demo.db")


@dataclass(frozen=True)
class DemoOptions:
    """What ``quantwatch demo`` was asked for; validated on construction (``ValueError`` names the option)."""

    steps: int = DEFAULT_STEPS
    recipe: str = "mixed"
    seed: int = 0
    keep_serving: bool = False
    url: str | None = None
    token: str | None = None
    database: Path = DEFAULT_DATABASE
    port: int = 8000
    remediate: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


@dataclass
class DemoResult:
    """What a demo run produced, for the summary and for tests."""

    run: str
    url: str
    steps: int
    seconds: float
    points_sent: int
    notifications: list[Notification] = field(default_factory=list)
    webhook_secret: str | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    actions: list[dict[str, Any]] = field(default_factory=list)
