"""The stored form of a metric rule's series states by column (one row per (rule, run, rank)), both versions.

Version 1 (migration 0011) stored ``["columns", layers, seen, status, last step, streak, clear streak, last value]``
as JSON lists: about 27 KB for a rank of 512 layers, rewritten by every batch that advances the rank (on PostgreSQL a
TOASTed value of about 9 KB and its dead tuple each time: a quarter of what one-step batches leave on disk). Version 2
(migration 0016) stores ``["columns2", names, fields]``, two base64 strings of zlib-compressed bytes:

* ``names``: the layer names as a JSON list (a run sends the same list in every batch, so the string is made once per
  list and decoded once per string);
* ``fields``: a header (the number of layers, the bytes per last value), then ``seen`` as a bit per layer, ``status``
  as one byte, the newest step, streak and clear streak as little-endian int64, and the last values as float32 when
  every one of them is a float32 (the wire's values always are) else float64, their bytes shuffled (all the first bytes
  of the values, then all the second bytes…: neighbouring layers' values share exponents, so zlib finds the runs).
  A non-finite last value is kept as it is.

About 4.3 KB for 512 layers (1.7 KB of it the names), encoded in a fifth of the time and decoded in a sixth (a
batch that moves an episode decodes every rank's row of the rule). Both versions are read; the engine writes version 2.
"""

from __future__ import annotations

import base64
import functools
import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["COLUMNS_TAG", "COLUMNS_V1_TAG", "ColumnFields", "decode_columns", "encode_columns"]

COLUMNS_TAG = "columns2"
"""First element of a stored columnar row of version 2 (a JSON list; rows of per-layer states are JSON objects)."""
COLUMNS_V1_TAG = "columns"
"""First element of a stored columnar row of version 1 (still read)."""

ColumnFields = tuple[
    tuple[str, ...],
    npt.NDArray[np.bool_],
    npt.NDArray[np.int8],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.float64],
]
"""(layers, seen, status, last step, streak, clear streak, last value): one entry per layer in each array."""

_HEADER = struct.Struct("<IB")  # layers, bytes per last value
_INT64 = np.dtype("<i8")
_ZLIB_LEVEL = 1  # rewritten on every batch: level 1 compresses these bytes within a few percent of level 9


def encode_columns(fields: ColumnFields) -> list[Any]:
    """The stored row of version 2 of one rule's columns (see the module's docstring)."""
    layers, seen, status, last, streak, clear, values = fields
    narrow = values.astype("<f4")
    stored = narrow if np.array_equal(narrow, values, equal_nan=True) else np.ascontiguousarray(values, dtype="<f8")
    parts = (
        _HEADER.pack(len(layers), stored.itemsize),
        np.packbits(seen).tobytes(),
        status.astype(np.int8).tobytes(),
        last.astype(_INT64).tobytes(),
        streak.astype(_INT64).tobytes(),
        clear.astype(_INT64).tobytes(),
        stored.view(np.uint8).reshape(len(layers), stored.itemsize).T.tobytes(),
    )
    return [COLUMNS_TAG, _encode_names(tuple(layers)), _text(b"".join(parts))]


def decode_columns(row: Sequence[Any]) -> ColumnFields:
    """The columns of a stored row of either version."""
    if row[0] == COLUMNS_V1_TAG:
        _, layers, seen, status, last, streak, clear, values = row
        return (
            tuple(layers),
            np.array(seen, dtype=bool),
            np.array(status, dtype=np.int8),
            np.array(last, dtype=np.int64),
            np.array(streak, dtype=np.int64),
            np.array(clear, dtype=np.int64),
            np.array(values, dtype=np.float64),
        )
    _, names, fields = row
    layers = _decode_names(names)
    raw = zlib.decompress(base64.b64decode(fields))
    count, width = _HEADER.unpack_from(raw)
    if count != len(layers):
        raise ValueError(f"a stored columnar row holds {count} layers' fields for {len(layers)} layer names")
    offset = _HEADER.size
    packed = np.frombuffer(raw, np.uint8, (count + 7) // 8, offset)
    offset += packed.size
    status = np.frombuffer(raw, np.int8, count, offset).copy()
    offset += count
    ints = [np.frombuffer(raw, _INT64, count, offset + i * 8 * count).astype(np.int64) for i in range(3)]
    offset += 3 * 8 * count
    shuffled = np.frombuffer(raw, np.uint8, count * width, offset).reshape(width, count)
    values = shuffled.T.copy().view("<f4" if width == 4 else "<f8").reshape(count)
    return (
        layers,
        np.unpackbits(packed, count=count).astype(bool),
        status,
        ints[0],
        ints[1],
        ints[2],
        values.astype(np.float64),
    )


def _text(data: bytes, level: int = _ZLIB_LEVEL) -> str:
    return base64.b64encode(zlib.compress(data, level)).decode("ascii")


@functools.lru_cache(maxsize=256)
def _encode_names(layers: tuple[str, ...]) -> str:
    return _text(json.dumps(list(layers), separators=(",", ":")).encode(), 9)  # made once per layer list


@functools.lru_cache(maxsize=256)
def _decode_names(names: str) -> tuple[str, ...]:
    return tuple(json.loads(zlib.decompress(base64.b64decode(names))))
