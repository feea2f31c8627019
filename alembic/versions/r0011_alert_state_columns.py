"""Alert series states by column: a metric rule's row holds one array per field over its layers (issue 21).

``alert_series_states.series`` of a metric rule without a baseline becomes ``["columns", layers, seen, status,
last_step, streak, clear_streak, last_value]`` (see ``quantwatch.service.alerts.columns.ColumnStates``) the next time
the engine writes it; rows of the per-layer form (a JSON object) are still read as they are, so the upgrade changes
nothing. The downgrade writes every columnar row back in the per-layer form.
"""

from __future__ import annotations

from typing import Any

from quantwatch.service.migrations.common import rewrite_series_states

revision: str = "0011_alert_state_columns"
down_revision: str | None = "0010_actions"


def upgrade() -> None:
    """Nothing to rewrite: both forms are read."""


def _per_layer(columns: list[Any]) -> dict[str, list[Any]]:
    _, layers, seen, status, last, streak, clear, values = columns
    return {
        layer: [status[i], last[i], streak[i], clear[i]] + ([] if values[i] is None else [values[i]])
        for i, layer in enumerate(layers)
        if seen[i]
    }


def downgrade() -> None:
    rewrite_series_states(lambda series: _per_layer(series) if isinstance(series, list) else None)
