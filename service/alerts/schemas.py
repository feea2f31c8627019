"""Pydantic models of the alerting API's answers (times are seconds since the epoch, like the rest of the API)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.tables import DeliveryRow, EpisodeRow, ReceiverRow, RuleRow

__all__ = ["AlertOut", "DeliveryOut", "ReceiverOut", "RuleOut", "Transition"]

Value = float | str | None


class RuleOut(Rule):
    """A rule as stored, with where it came from."""

    source: Literal["default", "file", "api"] = Field(description="Shipped default, rules file, or the API.")
    revision: int = Field(description="Bumped on every change; series state restarts with each revision.")

    @classmethod
    def of(cls, row: RuleRow) -> RuleOut:
        """The answer for a stored rule."""
        return cls.model_validate(
            {**row.definition, "enabled": row.enabled, "source": row.source, "revision": row.revision}
        )


class ReceiverOut(BaseModel):
    """A receiver as the API shows it: secrets and header values are write-only and never returned."""

    name: str
    type: Literal["webhook", "alertmanager"]
    url: str
    secret_count: int = Field(description="How many signing secrets are configured (their values are write-only).")
    header_names: list[str] = Field(description="Extra headers sent (values are write-only: they may hold tokens).")
    timeout_seconds: float
    send_resolved: bool
    enabled: bool
    disabled_reason: str | None = Field(description="Why the collector disabled it (a 410 Gone answer).")
    source: Literal["file", "api"]

    @classmethod
    def of(cls, row: ReceiverRow) -> ReceiverOut:
        """The answer for a stored receiver."""
        return cls(
            name=row.name,
            type=row.type,  # type: ignore[arg-type]
            url=row.url,
            secret_count=len(row.secrets),
            header_names=sorted(row.headers),
            timeout_seconds=row.timeout_seconds,
            send_resolved=row.send_resolved,
            enabled=row.enabled,
            disabled_reason=row.disabled_reason,
            source=row.source,  # type: ignore[arg-type]
        )


class Transition(BaseModel):
    """When an episode entered a state: the training step and the step's time."""

    step: int
    time: float


class AlertOut(BaseModel):
    """One episode of a rule on (run, layer), across ranks."""

    id: int
    rule: str
    run: str
    layer: str | None = Field(description="null for scalar rules.")
    state: Literal["pending", "firing", "resolved"]
    severity: str
    ranks: list[int] = Field(description="Ranks whose series took part.")
    step: int = Field(description="Step of the latest transition.")
    value: Value = Field(description="Value at that step ('nan', 'inf', '-inf' for non-finite values).")
    latest_step: int = Field(
        description="Latest step the episode was seen in its state: while pending or firing, the newest step its "
        "series were evaluated at in that state; once resolved, the step it resolved at."
    )
    pending: Transition | None
    firing: Transition | None
    resolved: Transition | None
    labels: dict[str, str]
    annotations: dict[str, str]

    @classmethod
    def of(cls, row: EpisodeRow, latest_step: int | None = None) -> AlertOut:
        """The answer for a stored episode; ``latest_step`` from its series (None: the latest transition's)."""

        def at(step: int | None, moment: float | None) -> Transition | None:
            return Transition(step=step, time=moment) if step is not None and moment is not None else None

        return cls(
            id=row.id,
            rule=row.rule_name,
            run=row.run,
            layer=row.layer or None,
            state=row.state,  # type: ignore[arg-type]
            severity=row.severity,
            ranks=list(row.ranks),
            step=row.step,
            value=row.value if row.value is not None else row.value_text,
            latest_step=max(row.step, latest_step) if latest_step is not None else row.step,
            pending=at(row.pending_step, row.pending_at),
            firing=at(row.firing_step, row.firing_at),
            resolved=at(row.resolved_step, row.resolved_at),
            labels=dict(row.labels),
            annotations=dict(row.annotations),
        )


class DeliveryOut(BaseModel):
    """One notification to one receiver, and how its delivery went."""

    id: int
    episode_id: int
    receiver: str
    event: Literal["firing", "resolved"]
    webhook_id: str = Field(description="Stable across retries and redeliveries (Standard Webhooks `webhook-id`).")
    status: Literal["pending", "delivered", "failed", "cancelled"]
    attempts: int
    created_at: float
    next_attempt_at: float
    expires_at: float = Field(description="Retries stop after this moment (the delivery horizon).")
    delivered_at: float | None
    last_status_code: int | None
    last_error: str | None

    @classmethod
    def of(cls, row: DeliveryRow, receiver: str) -> DeliveryOut:
        """The answer for a stored delivery."""
        return cls(
            id=row.id,
            episode_id=row.episode_id,
            receiver=receiver,
            event=row.event,  # type: ignore[arg-type]
            webhook_id=row.webhook_id,
            status=row.status,  # type: ignore[arg-type]
            attempts=row.attempts,
            created_at=row.created_at,
            next_attempt_at=row.next_attempt_at,
            expires_at=row.expires_at,
            delivered_at=row.delivered_at,
            last_status_code=row.last_status_code,
            last_error=row.last_error,
        )
