"""The exposition's reads from the database, each a function returning plain values (the only SQL of the package)."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.alerts.tables import DeliveryRow
from quantwatch.service.exposition.alert_states import DeliveryCounts

__all__ = ["delivery_counts"]


def delivery_counts(sessions: sessionmaker[Session]) -> DeliveryCounts:
    """Outbox deliveries per status, read from the database (an index-only count) at scrape time."""

    def count() -> Mapping[str, int]:
        with sessions() as session:
            rows = session.execute(select(DeliveryRow.status, func.count()).group_by(DeliveryRow.status))
            return {str(status): int(total) for status, total in rows}

    return count
