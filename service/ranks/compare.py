"""The cross-rank comparison of one step's fingerprints within one replica group (pure; no I/O).

``rank_weight_mismatch`` of rank r in layer L is 0 when r's bits checksum equals the reference's (the float64 sums
are not compared for identity: ranks with other thread counts or devices may add in another order and round
differently; the integer checksum is exact in any order); else a lower bound of the relative L2 distance
‖W_r − W_ref‖₂ / ‖W_ref‖₂ from the sums:

    max(|√Σw_r² − √Σw_ref²| / √Σw_ref²,  |Σw_r − Σw_ref| / max(|Σw_ref|, √Σw_ref²),  2⁻²³)

(reverse triangle inequality for the first term; the second is the brief's spread of the sums; the floor keeps a
difference the sums cannot resolve — the same sums, other bits — above 0, at float32's resolution).  It is +inf when
the reference is all zeros and r is not, or when the sums are not finite.  The reference of a layer is the
checksum a strict majority of the group holds, else the lowest rank's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["MISMATCH_FLOOR", "Fingerprint", "LayerVerdict", "compare_layer", "mismatch"]

MISMATCH_FLOOR = 2.0**-23

Fingerprint = tuple[str, float, float]
"""(bits checksum, Σw, Σw²) of one layer on one rank."""


@dataclass(frozen=True)
class LayerVerdict:
    """One layer at one step: its reference rank, whether a majority chose it, and each rank's mismatch."""

    layer: str
    reference_rank: int
    majority: bool
    values: Mapping[int, float]

    @property
    def differing(self) -> list[int]:
        """Ranks whose weights differ from the reference's, ascending."""
        return sorted(rank for rank, value in self.values.items() if value != 0.0)


def mismatch(mine: Fingerprint, reference: Fingerprint) -> float:
    """``rank_weight_mismatch`` of ``mine`` against ``reference`` (module docstring)."""
    if mine[0] == reference[0]:
        return 0.0
    _, s, q = mine
    _, s_ref, q_ref = reference
    if not all(math.isfinite(v) for v in (s, q, s_ref, q_ref)):
        return math.inf
    norm_ref = math.sqrt(max(q_ref, 0.0))
    if norm_ref == 0.0:
        return math.inf
    by_norm = abs(math.sqrt(max(q, 0.0)) - norm_ref) / norm_ref
    by_sum = abs(s - s_ref) / max(abs(s_ref), norm_ref)
    return max(by_norm, by_sum, MISMATCH_FLOOR)


def compare_layer(layer: str, prints: Mapping[int, Fingerprint]) -> LayerVerdict:
    """Compare the ranks that fingerprinted ``layer`` (at least one)."""
    ranks: Sequence[int] = sorted(prints)
    counts = Counter(prints[r][0] for r in ranks)
    common, held = counts.most_common(1)[0]
    majority = held * 2 > len(ranks)
    reference_rank = next(r for r in ranks if prints[r][0] == common) if majority else ranks[0]
    reference_print = prints[reference_rank]
    values = {rank: mismatch(prints[rank], reference_print) for rank in ranks}
    return LayerVerdict(layer, reference_rank, majority, values)
