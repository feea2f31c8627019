"""ORM tables of the cross-rank checks (migration ``0005_ranks``). Runs are referenced by name, as on the wire.

* ``rank_fingerprints``: one row per (run, replica group, step, rank) that sent fingerprints, until the step is
  decided (then deleted): the layers and their (hash, Σw, Σw²) as JSON.
* ``rank_comparisons``: one row per decided (run, group, step): ``compared`` (every rank of the group reported) with
  the layers whose ranks differ, or ``incomplete`` (some rank had not reported when the wait ran out).
* ``rank_environments``: each rank's environment, last report wins.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Double, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from quantwatch.service.models import Base

__all__ = ["RankComparisonRow", "RankEnvironmentRow", "RankFingerprintRow"]


class RankFingerprintRow(Base):
    """One rank's fingerprints of one step, waiting for the rest of its replica group."""

    __tablename__ = "rank_fingerprints"

    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    group_key: Mapped[str] = mapped_column(String(400), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    prints: Mapped[dict[str, Any]] = mapped_column(JSON)
    received_at: Mapped[float] = mapped_column(Double)


class RankComparisonRow(Base):
    """The decision on one step of one replica group."""

    __tablename__ = "rank_comparisons"

    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    group_key: Mapped[str] = mapped_column(String(400), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    status: Mapped[str] = mapped_column(String(16))  # compared | incomplete
    reported: Mapped[list[int]] = mapped_column(JSON)
    mismatches: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    decided_at: Mapped[float] = mapped_column(Double)


class RankEnvironmentRow(Base):
    """The environment one rank of a run reported."""

    __tablename__ = "rank_environments"

    run: Mapped[str] = mapped_column(String(200), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    environment: Mapped[dict[str, str]] = mapped_column(JSON)
    group_key: Mapped[str] = mapped_column(String(400))
    reported_at: Mapped[float] = mapped_column(Double)
