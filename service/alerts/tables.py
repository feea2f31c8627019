"""ORM tables of the alerting part (migration ``alerts_0001`` on top of the service's first revision).

Times are UNIX epoch seconds (``Double``): the evaluator compares and schedules with them, the API formats them.
Runs are referenced by name, like on the wire, so alert state does not depend on how runs are keyed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Double, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from quantwatch.service.models import Base, RowId

__all__ = [
    "SERIES_FIELDS",
    "SERIES_STATUSES",
    "AlertCursorRow",
    "AlertGroupRow",
    "DeliveryRow",
    "EpisodeRow",
    "FiringTokenRow",
    "LayerFormatRow",
    "ReceiverRow",
    "RuleRow",
    "SeriesStatesRow",
]

OPEN_EPISODE_STATES = ("pending", "firing")


class RuleRow(Base):
    """A rule: the validated :class:`~quantwatch.service.alerts.rules.Rule` as JSON, and where it came from."""

    __tablename__ = "alert_rules"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    source: Mapped[str] = mapped_column(String(16))  # default | file | api
    definition: Mapped[dict[str, Any]] = mapped_column(JSON)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    revision: Mapped[int] = mapped_column(Integer, default=1)
    updated_at: Mapped[float] = mapped_column(Double)


class ReceiverRow(Base):
    """A notification receiver; ``secrets`` never leave the service."""

    __tablename__ = "alert_receivers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    source: Mapped[str] = mapped_column(String(16))  # file | api
    type: Mapped[str] = mapped_column(String(16))  # webhook | alertmanager
    url: Mapped[str] = mapped_column(Text)
    secrets: Mapped[list[str]] = mapped_column(JSON, default=list)
    headers: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    timeout_seconds: Mapped[float] = mapped_column(Double, default=5.0)
    send_resolved: Mapped[bool] = mapped_column(Boolean, default=True)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    disabled_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[float] = mapped_column(Double)


class AlertCursorRow(Base):
    """One row per (run, rank): locked for the duration of an ingest transaction that evaluates that rank.

    Two replicas ingesting the same rank serialise here, so a series' state is read and written by one at a time.
    """

    __tablename__ = "alert_cursors"

    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)


class FiringTokenRow(Base):
    """The firing tokens of a run (migration 0013): a random ``token`` per (run, rank), drawn by every transaction of
    that rank's ingest that changes the run's list of firing episodes (one fires, resolves, or fires on more ranks),
    on whichever replica it runs; rank -1 is the rule routes' (they end episodes too). The run's tokens together tell
    a process that keeps the list it read last whether it is current. One row per rank, not per run: the row's lock,
    held to the commit on PostgreSQL, is then one that the rank's batches take in turn already (its cursor), not a
    queue of every rank of a flapping run. A run without rows has no change since the migration."""

    __tablename__ = "alert_firing_tokens"

    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    token: Mapped[int] = mapped_column(BigInteger)


class SeriesStatesRow(Base):
    """Evaluator state of every series of one (rule, run, rank), in one row (migration 0008).

    ``series`` is a metric rule's columns (a list, :mod:`~quantwatch.service.alerts.state_codec`: every layer's state
    as one array per field, compressed since migration 0016), or maps each layer (``""`` for a scalar rule) to the list
    :data:`SERIES_FIELDS` names, trailing ``None`` fields left out (baseline and scalar rules, and every row written
    before migration 0011). One row per rule and rank, so a batch reads and writes one row per rule instead of one
    per (rule, layer): every series of a rank advances at each sampled step. ``token`` is drawn at random on each
    write: a replica that still holds the states it wrote last reads only the token to know they are current.
    """

    __tablename__ = "alert_series_states"

    rule_id: Mapped[int] = mapped_column(ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True)
    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    token: Mapped[int] = mapped_column(BigInteger)
    series: Mapped[dict[str, list[Any]] | list[Any]] = mapped_column(JSON)


SERIES_FIELDS = ("status", "last_step", "streak", "clear_streak", "last_value", "baseline", "baseline_since")
"""The fields of one series in :attr:`SeriesStatesRow.series`; ``status`` as its index in :data:`SERIES_STATUSES`."""

SERIES_STATUSES = ("inactive", "pending", "firing")


class AlertGroupRow(Base):
    """One row per (rule, run, layer): the lock taken before an episode changes, and the open episode if any."""

    __tablename__ = "alert_groups"

    rule_id: Mapped[int] = mapped_column(ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True)
    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    layer: Mapped[str] = mapped_column(String(500), primary_key=True)
    episode_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class EpisodeRow(Base):
    """An alert episode of (rule, run, layer), with the step and time of each transition."""

    __tablename__ = "alert_episodes"
    __table_args__ = (
        # At most one open episode per (rule, run, layer), enforced by the database on both backends.
        Index(
            "uq_alert_episodes_open",
            "rule_id",
            "run",
            "layer",
            unique=True,
            sqlite_where=text("state IN ('pending', 'firing')"),
            postgresql_where=text("state IN ('pending', 'firing')"),
        ),
        Index("ix_alert_episodes_run_state", "run", "state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rule_id: Mapped[int | None] = mapped_column(ForeignKey("alert_rules.id", ondelete="SET NULL"), nullable=True)
    rule_name: Mapped[str] = mapped_column(String(128))
    run: Mapped[str] = mapped_column(String(200))
    layer: Mapped[str] = mapped_column(String(500))
    state: Mapped[str] = mapped_column(String(16))  # pending | firing | resolved
    severity: Mapped[str] = mapped_column(String(16))
    ranks: Mapped[list[int]] = mapped_column(JSON, default=list)
    step: Mapped[int] = mapped_column(BigInteger)  # step of the latest transition
    value: Mapped[float | None] = mapped_column(Double, nullable=True)  # value at that step (NULL: non-finite)
    value_text: Mapped[str | None] = mapped_column(String(8), nullable=True)  # "nan" / "inf" / "-inf"
    pending_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    pending_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    firing_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    firing_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resolved_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    annotations: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)


class DeliveryRow(Base):
    """The outbox: one notification for one receiver, written in the ingest transaction, delivered by the worker.

    ``webhook_id`` is fixed when the row is written, so it is the same on every retry and on redelivery.
    ``claimed_until`` is a lease: a worker that dies mid-send leaves the row to be retried by another after it.
    """

    __tablename__ = "alert_deliveries"
    __table_args__ = (
        Index("ix_alert_deliveries_due", "status", "next_attempt_at"),
        Index("ix_alert_deliveries_episode_receiver", "episode_id", "receiver_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    episode_id: Mapped[int] = mapped_column(ForeignKey("alert_episodes.id", ondelete="CASCADE"))
    receiver_id: Mapped[int] = mapped_column(ForeignKey("alert_receivers.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(16))  # firing | resolved
    webhook_id: Mapped[str] = mapped_column(String(64), unique=True)
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # pending | delivered | failed | cancelled
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Double)
    next_attempt_at: Mapped[float] = mapped_column(Double)
    expires_at: Mapped[float] = mapped_column(Double)
    claimed_until: Mapped[float | None] = mapped_column(Double, nullable=True)
    delivered_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


class LayerFormatRow(Base):
    """A layer's number format for one tensor kind from ``step`` on, as the agent declared it (``layer_formats``).

    A new row only when the format differs from the one in effect at that step, so a layer whose format changes
    mid-run keeps its history, each change with its step (migration 0004). Rules select layers by format and
    baseline-relative rules start their baseline again at a change.
    """

    __tablename__ = "layer_formats"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[str] = mapped_column(String(500), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # weight | input | grad
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    format: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[float] = mapped_column(Double)
