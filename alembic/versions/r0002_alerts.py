"""Alerts: rules, receivers, per-series evaluator state, episode groups, episodes and the delivery outbox."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from alembic import op
from quantwatch.service.migrations.common import fk, layer, rank, run_name, step

revision: str = "0002_alerts"
down_revision: str | None = "0001_service"

OPEN = sa.text("state IN ('pending', 'firing')")


def _rule_fk(table: str, ondelete: str = "CASCADE") -> sa.ForeignKeyConstraint:
    return fk(table, "rule_id", "alert_rules", ondelete=ondelete)


def _catalog_table(table: str, *columns: sa.Column[Any]) -> None:
    """A catalog of named objects (rules, receivers): id, unique name, where it came from (``source``), ``columns``
    and when it last changed."""
    op.create_table(
        table,
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        *columns,
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=f"pk_{table}"),
        sa.UniqueConstraint("name", name=f"uq_{table}_name"),
    )


def upgrade() -> None:
    """Create the alert tables."""
    _catalog_table(
        "alert_rules",
        sa.Column("definition", sa.JSON(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
    )
    _catalog_table(
        "alert_receivers",
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("secrets", sa.JSON(), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("timeout_seconds", sa.Double(), nullable=False),
        sa.Column("send_resolved", sa.Boolean(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
    )
    op.create_table(
        "alert_cursors",
        run_name(),
        rank(),
        sa.PrimaryKeyConstraint("run", "rank", name="pk_alert_cursors"),
    )
    op.create_table(
        "alert_series",
        sa.Column("rule_id", sa.Integer(), nullable=False),
        run_name(),
        rank(),
        layer(),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("streak", sa.Integer(), nullable=False),
        sa.Column("clear_streak", sa.Integer(), nullable=False),
        sa.Column("last_value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("rule_id", "run", "rank", "layer", name="pk_alert_series"),
        _rule_fk("alert_series"),
    )
    op.create_table(
        "alert_groups",
        sa.Column("rule_id", sa.Integer(), nullable=False),
        run_name(),
        layer(),
        sa.Column("episode_id", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("rule_id", "run", "layer", name="pk_alert_groups"),
        _rule_fk("alert_groups"),
    )
    op.create_table(
        "alert_episodes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=True),
        sa.Column("rule_name", sa.String(128), nullable=False),
        run_name(),
        layer(),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        step(),
        sa.Column("value", sa.Double(), nullable=True),
        sa.Column("value_text", sa.String(8), nullable=True),
        sa.Column("pending_step", sa.BigInteger(), nullable=True),
        sa.Column("pending_at", sa.Double(), nullable=True),
        sa.Column("firing_step", sa.BigInteger(), nullable=True),
        sa.Column("firing_at", sa.Double(), nullable=True),
        sa.Column("resolved_step", sa.BigInteger(), nullable=True),
        sa.Column("resolved_at", sa.Double(), nullable=True),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("annotations", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_alert_episodes"),
        _rule_fk("alert_episodes", ondelete="SET NULL"),
    )
    op.create_index(
        "uq_alert_episodes_open",
        "alert_episodes",
        ["rule_id", "run", "layer"],
        unique=True,
        sqlite_where=OPEN,
        postgresql_where=OPEN,
    )
    op.create_index("ix_alert_episodes_run_state", "alert_episodes", ["run", "state"])
    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("episode_id", sa.Integer(), nullable=False),
        sa.Column("receiver_id", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("webhook_id", sa.String(64), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("next_attempt_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("claimed_until", sa.Double(), nullable=True),
        sa.Column("delivered_at", sa.Double(), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_alert_deliveries"),
        fk("alert_deliveries", "episode_id", "alert_episodes", ondelete="CASCADE"),
        fk("alert_deliveries", "receiver_id", "alert_receivers", ondelete="CASCADE"),
        sa.UniqueConstraint("webhook_id", name="uq_alert_deliveries_webhook_id"),
    )
    op.create_index("ix_alert_deliveries_due", "alert_deliveries", ["status", "next_attempt_at"])
    op.create_index("ix_alert_deliveries_episode_receiver", "alert_deliveries", ["episode_id", "receiver_id"])


def downgrade() -> None:
    """Drop the alert tables."""
    for table in (
        "alert_deliveries",
        "alert_episodes",
        "alert_groups",
        "alert_series",
        "alert_cursors",
        "alert_receivers",
        "alert_rules",
    ):
        op.drop_table(table)
