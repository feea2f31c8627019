"""The lossless codec of a stored rollup block (issue 21): one row's min/max/sum/count of every layer in one blob.

Until revision 0017 a block was :data:`~quantwatch.service.rollups.STATS_DTYPE` per layer as it is (18 bytes): 15% of
the database of bench/storage_layout.py's 16-step batches, 28% of its 1-step ones. Within a block the four figures of
one layer are close relatives, so each is coded against what the others say: the max as the zigzag-coded difference
of its float32 bits from the min's (the sign, the exponent and the leading mantissa bits vanish), the float64 sum
XORed with the bits of ``(min + max) / 2 · count`` (the mean lies between min and max, so sign, exponent and leading
bits vanish again; the low bytes of a sum of float32 values are mostly zero already), and the count, in nearly every
block the same for every layer, once in the header. The records are split into byte planes (every layer's most
significant byte of the min, then the next, …, as the chunk codec does), in groups of :data:`GROUP_LAYERS` layers so
that a one-layer read (a series) inflates its own group only; the planes that shrink are deflated, the mostly-noise
ones (:data:`_STORED`) follow the stream as they are. On the series recorded
from the demo and the agent benchmark a block takes about half its bytes (0.50–0.54 by level on the demo's).

Layout (version 2; the unversioned records before it count as version 1): ``<BHI`` (version, the count of every layer
or :data:`PER_LAYER_COUNTS`, layers), ``groups`` × ``<I`` (where each group ends, counted from the first group's
start), then the groups: a raw deflate stream of the planes :data:`_DEFLATED` (and, with per-layer counts,
the count's two), then the planes :data:`_STORED` as they are.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from quantwatch.service.rollups import Partials

VERSION = 2
GROUP_LAYERS = 64
"""Layers per deflate stream (as in the chunk codec); with :data:`WINDOW_BITS` part of version 2's layout. On the
demo's series groups of 64 take 3% more bytes than groups of 128 and 9% more than one stream of 512 layers, but a
series read (one layer) inflates 1 KiB of each block it reads, not 2 or 8 (decoding one layer of a block: about 12 µs
instead of 15 with groups of 128, on the 2-core machine under load)."""
LEVEL = 6
WINDOW_BITS = 12
MEM_LEVEL = 4
"""A stream holds ~1 KiB (16 planes of 64 layers): a 4 KiB window and hash table see all of it, and zlib sets them up
in a quarter of the time of its default 32 KiB window and 64 KiB table (27 µs against 120 µs a stream: more than
deflating it)."""
PER_LAYER_COUNTS = 0xFFFF
"""The header's count when the layers' counts differ (a block never holds more than 4096 steps)."""
_HEADER = struct.Struct("<BHI")
HEADER_SIZE = _HEADER.size
_HEADS = np.dtype([("version", "u1"), ("count", "<u2"), ("layers", "<u4")])
"""The header as numpy reads it (packed: :data:`_HEADER`'s layout)."""
# One layer's coded record, most significant byte first, so that viewed as bytes its planes come out in order.
_CODED = np.dtype([("min", ">u4"), ("max", ">u4"), ("sum", ">u8"), ("count", ">u2")])
_PLANES = _CODED.itemsize
_SHARED_COUNT_PLANES = _PLANES - 2
"""Planes of a stream when the header holds the count."""
_DEFLATED = [0, 4, 5, 8, 9, 13, 14, 15]
"""Planes worth deflating: the min's top byte, the coded max's top two and the coded sum's top two and low three (on the
demo's series they shrink to 0.01–0.25 of their bytes, the coded max's second to 0.66). The other eight (the min's
low three bytes, the coded max's, the coded sum's middle three) are mostly noise (0.81–0.83 deflated) and are stored
after the stream as they are: deflating them cost as much time as all the others for 1.4 bytes per layer."""
_STORED = [1, 2, 3, 6, 7, 10, 11, 12]
_COUNT = [16, 17]
_ONE = struct.Struct("<I")
_PAIR = struct.Struct("<II")
U8 = npt.NDArray[np.uint8]


def _predicted_sums(
    vmin: npt.NDArray[np.float32], vmax: npt.NDArray[np.float32], count: npt.NDArray[np.integer]
) -> npt.NDArray[np.uint64]:
    """The bits of ``(min + max) / 2 · count`` in float64: what the sum is XORed with (any value decodes, even NaN:
    the decoder computes the same bits from the same min, max and count)."""
    with np.errstate(invalid="ignore", over="ignore"):
        pred = (vmin.astype(np.float64) + vmax.astype(np.float64)) * 0.5 * count.astype(np.float64)
    bits: npt.NDArray[np.uint64] = pred.view(np.uint64)
    return bits


def encode_blocks(part: Partials, rows: Sequence[int]) -> list[bytes]:
    """The blobs of the given rows of ``part`` (each row one block of every layer)."""
    take = np.asarray(rows, dtype=np.int64)
    vmin = np.ascontiguousarray(part.vmin[take], dtype=np.float32)
    vmax = np.ascontiguousarray(part.vmax[take], dtype=np.float32)
    count = part.vcount[take].astype(np.uint16)
    lo, hi = vmin.view(np.uint32), vmax.view(np.uint32)
    diff = (hi - lo).view(np.int32)
    coded = np.empty(vmin.shape, _CODED)
    coded["min"] = lo
    coded["max"] = (diff << np.int32(1)).view(np.uint32) ^ (diff >> np.int32(31)).view(np.uint32)
    coded["sum"] = part.vsum[take].astype(np.float64).view(np.uint64) ^ _predicted_sums(vmin, vmax, count)
    coded["count"] = count
    n_layers = vmin.shape[1]
    # (rows, planes, layers): each plane of a row's group is a contiguous slice once transposed.
    planes = np.ascontiguousarray(coded.view(np.uint8).reshape(len(take), n_layers, _PLANES).transpose(0, 2, 1))
    out = []
    for r in range(len(take)):
        shared = n_layers > 0 and bool((count[r] == count[r, 0]).all())
        streams = []
        deflated = _DEFLATED if shared else _DEFLATED + _COUNT
        for g in range(0, n_layers, GROUP_LAYERS):
            group = planes[r, :, g : g + GROUP_LAYERS]
            packer = zlib.compressobj(LEVEL, zlib.DEFLATED, -WINDOW_BITS, MEM_LEVEL)
            streams.append(packer.compress(group[deflated].tobytes()) + packer.flush() + group[_STORED].tobytes())
        ends = np.cumsum([len(s) for s in streams]).tolist()
        header = _HEADER.pack(VERSION, int(count[r, 0]) if shared else PER_LAYER_COUNTS, n_layers)
        out.append(header + struct.pack(f"<{len(ends)}I", *ends) + b"".join(streams))
    return out


def blob_layers(blob: bytes) -> int:
    """How many layers a blob holds."""
    layers: int = _HEADER.unpack_from(blob)[2]
    return layers


def _canonical(planes: U8, per_layer: bool) -> U8:
    """(rows, planes, layers) bytes in the order a stream holds them (then the header's count, when shared) put back
    in the order of :data:`_CODED`."""
    order = _DEFLATED + _COUNT + _STORED if per_layer else _DEFLATED + _STORED + _COUNT
    out: U8 = planes[:, np.argsort(order), :]
    return out


def _count_planes(counts: Sequence[int] | npt.NDArray[np.uint16], width: int) -> U8:
    """(rows, 2, width) bytes of a count per row shared by its layers."""
    count = np.array(counts, np.uint16)[:, None, None].repeat(width, axis=2)
    return np.concatenate([(count >> np.uint16(8)).astype(np.uint8), (count & np.uint16(0xFF)).astype(np.uint8)], 1)


def _row_planes(blob: bytes) -> U8:
    """The (planes, layers) bytes of every layer a blob holds."""
    version, count, held = _HEADER.unpack_from(blob)
    if version != VERSION:
        raise ValueError(f"rollup codec version {version} is not known (this collector reads {VERSION})")
    per_layer = count == PER_LAYER_COUNTS
    planes = _uniform_planes([blob], held, _PLANES if per_layer else _SHARED_COUNT_PLANES)
    if not per_layer:
        planes = np.concatenate([planes, _count_planes([count], planes.shape[2])], axis=1)
    row: U8 = _canonical(planes, per_layer)[0]
    return row


def _from_planes(planes: U8) -> Partials:
    """Inverse of the coding of :func:`encode_blocks` on (rows, planes, layers) bytes."""
    coded = np.ascontiguousarray(planes.transpose(0, 2, 1)).view(_CODED)[:, :, 0]
    lo = coded["min"].astype(np.uint32)
    zz = coded["max"].astype(np.uint32)
    hi = lo + ((zz >> np.uint32(1)) ^ (np.uint32(0) - (zz & np.uint32(1))))
    count = coded["count"].astype(np.int64)
    vmin, vmax = lo.view(np.float32), hi.view(np.float32)
    vsum = (coded["sum"].astype(np.uint64) ^ _predicted_sums(vmin, vmax, count)).view(np.float64)
    return Partials(vmin, vmax, vsum, count)


def _inflate(blob: bytes, start: int, end: int, width: int) -> bytes:
    """The planes of the group stored at ``blob[start:end]`` (``width`` layers): the deflated ones, then the stored
    (cut out of the blob here, not sliced first: a copy per group cost ~2% of decoding whole blocks)."""
    cut = end - len(_STORED) * width
    return zlib.decompress(blob[start:cut], -WINDOW_BITS) + blob[cut:end]


def _uniform_planes(blobs: Sequence[bytes], n_layers: int, n_planes: int) -> U8:
    """(rows, n_planes, layers) bytes of blobs that all hold ``n_layers`` layers and ``n_planes`` planes, inflated
    with one Python step per stream (a series reads ~800 blocks: per-row array work cost more than the inflating)."""
    groups = -(-n_layers // GROUP_LAYERS)
    table = _HEADER.size + 4 * groups
    rows = len(blobs)
    ends = struct.Struct(f"<{groups}I")
    widths = [min(GROUP_LAYERS, n_layers - g * GROUP_LAYERS) for g in range(groups)]
    data = b"".join(
        [
            _inflate(b, table + (e[g - 1] if g else 0), table + e[g], widths[g])
            for b in blobs
            for e in (ends.unpack_from(b, _HEADER.size),)
            for g in range(groups)
        ]
    )
    flat = np.frombuffer(data, np.uint8).reshape(rows, n_planes * n_layers)  # a row's groups one after another
    parts = []
    for a in range(0, n_layers, GROUP_LAYERS):
        width = min(GROUP_LAYERS, n_layers - a)
        parts.append(flat[:, n_planes * a : n_planes * (a + width)].reshape(rows, n_planes, width))
    out: U8 = np.concatenate(parts, axis=2) if parts else np.zeros((rows, n_planes, 0), np.uint8)
    return out


def _layer_group(blob: bytes, layer: int) -> bytes | None:
    """The stored group of ``blob`` that holds ``layer`` (None when the blob does not hold it)."""
    held = _HEADER.unpack_from(blob)[2]
    if layer >= held:
        return None
    g = layer // GROUP_LAYERS
    table = _HEADER.size + 4 * -(-held // GROUP_LAYERS)
    start, end = (
        _PAIR.unpack_from(blob, _HEADER.size + 4 * (g - 1)) if g else (0, _ONE.unpack_from(blob, _HEADER.size)[0])
    )
    return blob[table + start : table + end]


def decode_layer(heads: Sequence[bytes], groups: Sequence[bytes | None], layer: int) -> Partials:
    """Partials (rows × 1) of ``layer`` of stored blocks given each block's head (its first :data:`HEADER_SIZE` bytes
    or more) and the bytes of its group holding the layer (the ``layer // GROUP_LAYERS``-th: from the table's end
    after the previous group's end to the table's end after its own; a series read picks it out in SQL), None where the
    block does not hold the layer (narrower, written before the run grew: nothing measured there). Blocks of one
    layout (the group's width, a shared count or not) are decoded together, in a run's series all of them."""
    out = Partials.empty(len(heads), 1)
    if not heads:
        return out
    col = layer % GROUP_LAYERS
    # The headers as one array and the blocks' layouts as one key (a series reads ~800 blocks: unpacking and sorting
    # them one by one took twice as long, ~0.4 ms).
    head = np.frombuffer(b"".join([h[: _HEADER.size] for h in heads]), _HEADS)
    if (head["version"] != VERSION).any():
        version = int(head["version"][head["version"] != VERSION][0])
        raise ValueError(f"rollup codec version {version} is not known (this collector reads {VERSION})")
    widths = np.minimum(GROUP_LAYERS, head["layers"].astype(np.int64) - (layer - col))
    kinds = np.where(head["layers"] > layer, 2 * widths + (head["count"] == PER_LAYER_COUNTS), -1)
    for kind in np.unique(kinds[kinds >= 0]).tolist():
        width, per_layer = kind // 2, bool(kind % 2)
        rows = np.flatnonzero(kinds == kind)
        held = [groups[i] for i in rows.tolist()]
        if None in held:
            raise ValueError(f"a block holding layer {layer} came without the layer's group")
        data = b"".join([_inflate(g, 0, len(g), width) for g in held if g is not None])
        planes = np.frombuffer(data, np.uint8).reshape(rows.size, -1, width)[:, :, col, None]
        if not per_layer:
            planes = np.concatenate([planes, _count_planes(head["count"][rows], 1)], axis=1)
        part = _from_planes(_canonical(planes, per_layer))
        out.vmin[rows], out.vmax[rows], out.vsum[rows], out.vcount[rows] = part.vmin, part.vmax, part.vsum, part.vcount
    return out


def decode_blocks(blobs: Sequence[bytes], n_layers: int, layer: int | None = None) -> Partials:
    """Partials of stored blocks (rows × ``n_layers``), or of ``layer`` only (rows × 1); layers a blob does not
    hold are empty (nothing measured)."""
    if layer is not None:
        return decode_layer(blobs, [_layer_group(b, layer) for b in blobs], layer)
    if not blobs:
        return Partials.empty(0, n_layers)
    heads = list(map(_HEADER.unpack_from, blobs))
    counts = [h[1] for h in heads]
    shared = PER_LAYER_COUNTS not in counts
    if (
        {h[0] for h in heads} == {VERSION}
        and {h[2] for h in heads} == {n_layers}
        and (shared or set(counts) == {PER_LAYER_COUNTS})
    ):
        # The common case: every block as wide as the run, all with shared counts or none.
        planes = _uniform_planes(blobs, n_layers, _SHARED_COUNT_PLANES if shared else _PLANES)
        if shared:
            planes = np.concatenate([planes, _count_planes(counts, n_layers)], axis=1)
        return _from_planes(_canonical(planes, not shared))
    out = Partials.empty(len(blobs), n_layers)
    for i, blob in enumerate(blobs):
        part = _from_planes(_row_planes(blob)[None, :, :n_layers])
        held = part.vmin.shape[1]
        out.vmin[i, :held], out.vmax[i, :held] = part.vmin[0], part.vmax[0]
        out.vsum[i, :held], out.vcount[i, :held] = part.vsum[0], part.vcount[0]
    return out
