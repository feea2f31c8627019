"""The ORM table of the what-if statistics (migration ``0008_whatif``).

``whatif_points``: one row per (run, rank, step, layer, tensor kind, candidate) an agent's what-if step measured,
with the ``rel_l2``, ``underflow_ratio`` and ``overflow_ratio`` of that tensor quantized to the candidate (NULL: not
measured, or NaN) and ``own`` when the candidate is the layer's own format for that kind (from the batch's
``layer_formats``). Layers by name, as on the wire; deleted with their run.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Double, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from quantwatch.protocol import MAX_CANDIDATE_LENGTH, MAX_LAYER_NAME_LENGTH
from quantwatch.service.models import Base, RowId

__all__ = ["WhatIfRow"]


class WhatIfRow(Base):
    """One layer's tensor kind under one candidate at one step."""

    __tablename__ = "whatif_points"

    run_id: Mapped[int] = mapped_column(RowId, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    layer: Mapped[str] = mapped_column(String(MAX_LAYER_NAME_LENGTH), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    candidate: Mapped[str] = mapped_column(String(MAX_CANDIDATE_LENGTH), primary_key=True)
    own: Mapped[bool] = mapped_column(Boolean)
    rel_l2: Mapped[float | None] = mapped_column(Double, nullable=True)
    underflow_ratio: Mapped[float | None] = mapped_column(Double, nullable=True)
    overflow_ratio: Mapped[float | None] = mapped_column(Double, nullable=True)
