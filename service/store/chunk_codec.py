"""The lossless codec of a point chunk (issue 21): many raw rows of one (run, rank, metric) in three small blobs.

Values (``vals``): a (rows × layers) float32 matrix, lossless to the bit (NaN payloads and so the missing pattern,
-0, ±inf). Training figures are smooth series, so per layer along time each value's bits are XORed with the
previous step's (as Gorilla does): the sign, the exponent and the leading mantissa bits cancel. The XORed words are
then laid out layer-major and split into byte planes (every word's byte 3, then byte 2, …: the shuffle of Blosc and
HDF5), so the all-zero high planes and the noisy low ones each form long runs that zlib (stdlib) compresses
separately. Layers go in groups of :data:`GROUP_LAYERS`, each group its own zlib stream, so a one-layer read
decompresses one group, not the chunk.

Layout of ``vals``: ``<BIII`` (version, rows, layers, groups), ``groups`` × ``<I`` compressed sizes, the streams.
Steps (``steps``): zlib of the int64 deltas from the first step. Times (``times``): zlib of one byte per row (1 when
the row has a time) followed by the float64 times XORed with the previous row's, byte planes as above.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import numpy.typing as npt

from quantwatch.service.rollups import F32, I64

VERSION = 1
GROUP_LAYERS = 64
"""Layers per zlib stream: a one-layer read decompresses this many layers' bytes of the chunk."""
LEVEL = 6
STRATEGY = zlib.Z_RLE
"""zlib's strategy: run lengths and Huffman codes only, no string matching. The planes of XORed floats repeat no
strings but runs (the zero high planes); on recorded series this encodes 2.4× faster than the default strategy for
2% more bytes (64 rows × 512 layers: 0.85 ms instead of 2.1 ms)."""

_HEADER = struct.Struct("<BIII")
_SIZE = struct.Struct("<I")
U32 = npt.NDArray[np.uint32]


def _xor_planes(words: npt.NDArray[np.unsignedinteger]) -> bytes:
    """(rows × columns) words XORed along rows, column-major, as byte planes (most significant first)."""
    x = words.copy()
    x[1:] ^= words[:-1]
    col = np.ascontiguousarray(x.T).astype(x.dtype.newbyteorder("<"), copy=False)
    planes = col.view(np.uint8).reshape(col.shape[0], col.shape[1], col.dtype.itemsize)[:, :, ::-1]
    return np.ascontiguousarray(planes.transpose(2, 0, 1)).tobytes()


def _unxor_planes(
    data: bytes, rows: int, cols: int, dtype: type[np.unsignedinteger]
) -> npt.NDArray[np.unsignedinteger]:
    """Inverse of :func:`_xor_planes`."""
    size = np.dtype(dtype).itemsize
    planes = np.frombuffer(data, dtype=np.uint8).reshape(size, cols, rows)
    col = np.ascontiguousarray(planes[::-1].transpose(1, 2, 0)).view(np.dtype(dtype).newbyteorder("<"))
    x = col.reshape(cols, rows).T.astype(dtype)
    return np.bitwise_xor.accumulate(x, axis=0)


def _compress(data: bytes) -> bytes:
    packer = zlib.compressobj(LEVEL, zlib.DEFLATED, 15, 9, STRATEGY)
    return packer.compress(data) + packer.flush()


def encode_values(values: F32) -> bytes:
    """The ``vals`` blob of a (rows × layers) float32 matrix."""
    rows, cols = values.shape
    words = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    streams = [_compress(_xor_planes(words[:, g : g + GROUP_LAYERS])) for g in range(0, cols, GROUP_LAYERS)]
    head = _HEADER.pack(VERSION, rows, cols, len(streams)) + b"".join(_SIZE.pack(len(s)) for s in streams)
    return head + b"".join(streams)


def values_shape(blob: bytes) -> tuple[int, int]:
    """(rows, layers) of a ``vals`` blob."""
    version, rows, cols, _ = _HEADER.unpack_from(blob)
    if version != VERSION:
        raise ValueError(f"point chunk codec version {version} is not known (this collector reads {VERSION})")
    return rows, cols


def decode_values(blob: bytes, layer: int | None = None) -> F32:
    """The matrix of a ``vals`` blob, or only column ``layer`` (rows × 1; missing when the chunk is narrower)."""
    rows, cols = values_shape(blob)
    groups = -(-cols // GROUP_LAYERS)
    sizes = struct.unpack_from(f"<{groups}I", blob, _HEADER.size)
    offsets = np.cumsum([_HEADER.size + 4 * groups, *sizes]).tolist()
    wanted = range(groups) if layer is None else [layer // GROUP_LAYERS] if layer < cols else []
    parts = []
    for g in wanted:
        width = min(GROUP_LAYERS, cols - g * GROUP_LAYERS)
        raw = zlib.decompress(blob[offsets[g] : offsets[g + 1]])
        parts.append(_unxor_planes(raw, rows, width, np.uint32))
    if layer is not None:
        if not parts:
            return np.full((rows, 1), 0x7FC00001, dtype=np.uint32).view(np.float32)
        return np.ascontiguousarray(parts[0][:, [layer % GROUP_LAYERS]]).view(np.float32)
    return (np.concatenate(parts, axis=1) if parts else np.zeros((rows, 0), dtype=np.uint32)).view(np.float32)


def encode_steps(steps: I64) -> bytes:
    """The ``steps`` blob: the deltas from the first step."""
    return _compress(np.diff(steps, prepend=0).astype("<i8").tobytes())


def decode_steps(blob: bytes) -> I64:
    """Inverse of :func:`encode_steps`."""
    return np.cumsum(np.frombuffer(zlib.decompress(blob), dtype="<i8")).astype(np.int64)


def encode_times(times: list[float | None]) -> bytes:
    """The ``times`` blob: which rows have a time, then the float64 times."""
    has = np.array([t is not None for t in times], dtype=np.uint8)
    seconds = np.array([0.0 if t is None else t for t in times], dtype=np.float64)
    return _compress(has.tobytes() + _xor_planes(seconds.view(np.uint64)[:, None]))


def decode_times(blob: bytes, rows: int) -> list[float | None]:
    """Inverse of :func:`encode_times`."""
    data = zlib.decompress(blob)
    has = np.frombuffer(data[:rows], dtype=np.uint8).astype(bool)
    seconds = _unxor_planes(data[rows:], rows, 1, np.uint64)[:, 0].view(np.float64)
    return [float(t) if h else None for t, h in zip(seconds.tolist(), has.tolist(), strict=True)]
