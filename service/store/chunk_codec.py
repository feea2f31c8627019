"""The lossless codec of a point chunk (issue 21): many raw rows of one (run, rank, metric) in three small blobs.

Values (``vals``): a (rows × layers) float32 matrix, lossless to the bit (NaN payloads and so the missing pattern,
-0, ±inf). Training figures are smooth series, so per layer along time each value's bits, read as an integer, have the
previous step's subtracted (modulo 2³²) and are zigzag-coded (small negative and positive differences both become
small numbers): within one binade the difference of the bit patterns is the difference of the mantissas, so the sign,
the exponent and the leading mantissa bits vanish. The words are then laid out layer-major and split into byte planes
(every word's byte 3, then byte 2, …: the shuffle of Blosc and HDF5), each plane its own zlib (stdlib) stream, so the
near-zero high planes and the noisy low ones are coded apart; a plane that zlib cannot shrink (the lowest, mostly
noise) is stored as it is. Layers go in groups of :data:`GROUP_LAYERS`, so a one-layer read decompresses one group's
planes, not the chunk. On the series recorded from the demo and the agent benchmark this takes 10–13% fewer bytes
than version 1 (XOR with the previous value, the four planes in one stream), which chunks folded before still use.

Layout of ``vals`` (version 2): ``<BIII`` (version, rows, layers, groups), ``groups`` × 4 × ``<I`` stream sizes (the
high bit set: stored uncompressed), the streams, group by group, most significant plane first. Version 1: the same
header, ``groups`` × ``<I`` sizes, one zlib stream of XORed planes per group.
Steps (``steps``): zlib of the int64 deltas from the first step. Times (``times``): zlib of one byte per row (1 when
the row has a time) followed by the float64 times XORed with the previous row's, byte planes as above.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import numpy.typing as npt

from quantwatch.service.rollups import F32, I64

VERSION = 2
GROUP_LAYERS = 64
"""Layers per group of streams: a one-layer read decompresses this many layers' bytes of the chunk."""
LEVEL = 6
STRATEGY = zlib.Z_RLE
"""zlib's strategy: run lengths and Huffman codes only, no string matching. The planes of float differences repeat no
strings but runs (the zero high planes); on recorded series this encodes 2.4× faster than the default strategy for
2% more bytes (64 rows × 512 layers: 0.85 ms instead of 2.1 ms)."""

NOISE_BITS = 7.8
"""Bits per byte of a plane's byte histogram from which the plane, and every plane below it in its group, is stored
as it is without trying zlib: Huffman codes could take it down by at most 8 − that share, and deflating planes of
noise (the low ones of most figures: a difference's noise sits in its low bits, so below a plane of noise the planes
are noise too) costs as much as deflating useful ones. On the recorded series this makes the encoding about twice as
fast for the same bytes."""

_HEADER = struct.Struct("<BIII")
HEADER_SIZE = _HEADER.size
"""Bytes of a ``vals`` blob's header: enough for :func:`values_shape`."""
_STORED = 1 << 31
"""Flag of a stream size: the plane is stored uncompressed."""
PLANES = 4
U32 = npt.NDArray[np.uint32]


def _xor_planes(words: npt.NDArray[np.unsignedinteger]) -> bytes:
    """(rows × columns) words XORed along rows, column-major, as byte planes (most significant first)."""
    x = words.copy()
    x[1:] ^= words[:-1]
    return b"".join(_planes(x))


def _planes(words: npt.NDArray[np.unsignedinteger]) -> list[bytes]:
    """(rows × columns) words, column-major, as byte planes (most significant first)."""
    col = np.ascontiguousarray(words.T).astype(words.dtype.newbyteorder("<"), copy=False)
    planes = col.view(np.uint8).reshape(col.shape[0], col.shape[1], col.dtype.itemsize)[:, :, ::-1]
    return [planes[:, :, k].tobytes() for k in range(col.dtype.itemsize)]


def _words(
    planes: bytes, rows: int, cols: int, dtype: type[np.unsignedinteger], column: int | None = None
) -> npt.NDArray[np.unsignedinteger]:
    """Inverse of :func:`_planes` (the planes concatenated), or only its ``column`` (rows × 1)."""
    size = np.dtype(dtype).itemsize
    stacked = np.frombuffer(planes, dtype=np.uint8).reshape(size, cols, rows)
    if column is not None:  # layer-major planes: one layer's bytes are a slice of each, nothing else is reordered
        stacked, cols = stacked[:, column : column + 1], 1
    col = np.ascontiguousarray(stacked[::-1].transpose(1, 2, 0)).view(np.dtype(dtype).newbyteorder("<"))
    out: npt.NDArray[np.unsignedinteger] = col.reshape(cols, rows).T.astype(dtype)
    return out


def _unxor_planes(
    data: bytes, rows: int, cols: int, dtype: type[np.unsignedinteger], column: int | None = None
) -> npt.NDArray[np.unsignedinteger]:
    """Inverse of :func:`_xor_planes` (``column``: that one only)."""
    return np.bitwise_xor.accumulate(_words(data, rows, cols, dtype, column), axis=0)


def _entropy_bits(plane: bytes) -> float:
    """Shannon entropy of ``plane``'s byte histogram, in bits per byte."""
    counts = np.bincount(np.frombuffer(plane, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / len(plane)
    return float(-(p * np.log2(p)).sum())


def _compress(data: bytes) -> bytes:
    packer = zlib.compressobj(LEVEL, zlib.DEFLATED, 15, 9, STRATEGY)
    return packer.compress(data) + packer.flush()


def _zigzag_deltas(words: U32) -> U32:
    """Each word minus the one above it (modulo 2³²; the first row as it is), zigzag-coded."""
    delta = words.copy()
    delta[1:] -= words[:-1]
    out: U32 = (delta << np.uint32(1)) ^ (np.uint32(0) - (delta >> np.uint32(31)))
    return out


def _undo_zigzag_deltas(coded: U32) -> U32:
    """Inverse of :func:`_zigzag_deltas`."""
    delta = (coded >> np.uint32(1)) ^ (np.uint32(0) - (coded & np.uint32(1)))
    out: U32 = np.cumsum(delta, axis=0, dtype=np.uint32)
    return out


def encode_values(values: F32) -> bytes:
    """The ``vals`` blob of a (rows × layers) float32 matrix."""
    rows, cols = values.shape
    coded = _zigzag_deltas(np.ascontiguousarray(values, dtype=np.float32).view(np.uint32))
    sizes, streams = [], []
    for g in range(0, cols, GROUP_LAYERS):
        noise = False
        for plane in _planes(coded[:, g : g + GROUP_LAYERS]):
            noise = noise or _entropy_bits(plane) >= NOISE_BITS
            packed = plane if noise else _compress(plane)
            stored = len(packed) >= len(plane)
            streams.append(plane if stored else packed)
            sizes.append(len(streams[-1]) | (_STORED if stored else 0))
    groups = len(sizes) // PLANES
    return _HEADER.pack(VERSION, rows, cols, groups) + struct.pack(f"<{len(sizes)}I", *sizes) + b"".join(streams)


def values_shape(blob: bytes) -> tuple[int, int]:
    """(rows, layers) of a ``vals`` blob."""
    version, rows, cols, _ = _HEADER.unpack_from(blob)
    if version not in (1, VERSION):
        raise ValueError(f"point chunk codec version {version} is not known (this collector reads 1 and {VERSION})")
    return rows, cols


def _group_words(blob: bytes, version: int, groups: int, rows: int, width: int, g: int, column: int | None) -> U32:
    """The words of group ``g`` (``width`` layers) of a ``vals`` blob, or of its ``column`` only."""
    streams = 1 if version == 1 else PLANES
    sizes = struct.unpack_from(f"<{groups * streams}I", blob, _HEADER.size)
    lengths = [s & ~_STORED for s in sizes]
    offsets = np.cumsum([_HEADER.size + 4 * len(sizes), *lengths]).tolist()
    if version == 1:
        return _unxor_planes(zlib.decompress(blob[offsets[g] : offsets[g + 1]]), rows, width, np.uint32, column)
    planes = []
    for i in range(g * PLANES, (g + 1) * PLANES):
        data = blob[offsets[i] : offsets[i + 1]]
        planes.append(data if sizes[i] & _STORED else zlib.decompress(data))
    return _undo_zigzag_deltas(_words(b"".join(planes), rows, width, np.uint32, column))


def decode_values(blob: bytes, layer: int | None = None) -> F32:
    """The matrix of a ``vals`` blob, or only column ``layer`` (rows × 1; missing when the chunk is narrower)."""
    rows, cols = values_shape(blob)
    version, groups = blob[0], -(-cols // GROUP_LAYERS)
    if layer is not None:
        if layer >= cols:
            return np.full((rows, 1), 0x7FC00001, dtype=np.uint32).view(np.float32)
        g = layer // GROUP_LAYERS
        width = min(GROUP_LAYERS, cols - g * GROUP_LAYERS)
        return _group_words(blob, version, groups, rows, width, g, layer % GROUP_LAYERS).view(np.float32)
    parts = [
        _group_words(blob, version, groups, rows, min(GROUP_LAYERS, cols - g * GROUP_LAYERS), g, None)
        for g in range(groups)
    ]
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
