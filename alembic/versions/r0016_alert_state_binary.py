"""Alert series states by column in version 2: compressed binary arrays in the JSON row (issue 21).

``alert_series_states.series`` of a metric rule without a baseline becomes ``["columns2", names, fields]`` (see
``quantwatch.service.alerts.state_codec``: base64 of the zlib-compressed layer names and of the packed fields, about
4 KB for 512 layers instead of 27 KB) the next time the engine writes it; rows of version 1 (``["columns", …]``) and of
the per-layer form are still read as they are, so the upgrade changes nothing. The downgrade writes every row of
version 2 back in version 1, which the code before this revision reads.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import zlib
from typing import Any

import numpy as np

from quantwatch.service.migrations.common import rewrite_series_states

revision: str = "0016_alert_state_binary"
down_revision: str | None = "0015_lean_storage"

VERSION_2 = "columns2"
HEADER = struct.Struct("<IB")  # version 2's tag and header at this revision (frozen: the code's may change)


def upgrade() -> None:
    """Nothing to rewrite: every form is read."""


def _version_1(row: list[Any]) -> list[Any]:
    """A version 2 row as ``["columns", layers, seen, status, last, streak, clear, values]`` (non-finite: null)."""
    _, names, fields = row
    layers = json.loads(zlib.decompress(base64.b64decode(names)))
    raw = zlib.decompress(base64.b64decode(fields))
    count, width = HEADER.unpack_from(raw)
    offset = HEADER.size
    seen = np.unpackbits(np.frombuffer(raw, np.uint8, (count + 7) // 8, offset), count=count).astype(bool)
    offset += (count + 7) // 8
    status = np.frombuffer(raw, np.int8, count, offset)
    offset += count
    ints = [np.frombuffer(raw, "<i8", count, offset + i * 8 * count) for i in range(3)]
    offset += 3 * 8 * count
    shuffled = np.frombuffer(raw, np.uint8, count * width, offset).reshape(width, count)
    values = shuffled.T.copy().view("<f4" if width == 4 else "<f8").reshape(count).astype(np.float64).tolist()
    return [
        "columns",
        layers,
        seen.tolist(),
        status.tolist(),
        *(array.tolist() for array in ints),
        [value if math.isfinite(value) else None for value in values],
    ]


def downgrade() -> None:
    rewrite_series_states(
        lambda series: _version_1(series) if isinstance(series, list) and series[0] == VERSION_2 else None
    )
