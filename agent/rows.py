"""``shadow_rows=``: the FP32 shadow comparisons on a seeded random subset of rows, an estimate at less cost.

``output_*`` and ``update_cosine`` are defined by an FP32 reference forward and an FP32 reference weight gradient of
every layer: two extra matmuls per layer per sampled step.  With ``shadow_rows`` they are estimated from a subset, for
``nn.Linear`` layers (``QuantLinear``, torch.ao QAT ``Linear``; other layers stay exact):

* **Which rows.** The rows of a call are its tokens: the input and output flattened over every leading dimension
  (``(batch, seq, features)`` → ``batch·seq`` rows).  ``shadow_rows=f`` (0 < f ≤ 1) keeps ``k = ceil(f·n)`` of the
  ``n`` rows, ``shadow_rows=c`` (int ≥ 1) keeps ``k = min(c, n)``.  The draw is *stratified*: the ``n`` rows are cut
  into ``k`` consecutive strata of (nearly) equal size and one row is drawn uniformly from each, so every row is kept
  with probability ``k/n``, no row twice, and the kept rows spread over the whole batch (every sequence, every
  position range) at the cost of ``k`` random numbers.  With ``k = n`` the figures are exact and not marked.
* **Seeded how.** Each layer draws from its own generator, seeded with ``SEED + layer index`` (the position in
  ``monitor.layers``) when the monitor is made: NumPy's ``default_rng`` for CPU tensors, a ``torch.Generator`` on
  the layer's device otherwise (no host round trip); draws advance it call by call, so a run's subsets are the same
  every time it is repeated, on every rank, and independent across layers.
* **output_*.** The reference runs on the kept rows only (``reference_forward(x[rows])``, ``k/n`` of its cost) and is
  compared with the same rows of the quantized output.  Each sum (Σx², Σq², Σqx, Σ(q−x)², and the count) is scaled
  by ``n/k`` (Horvitz–Thompson), so sums from calls of different sizes combine as estimates of the full sums; the
  figures are the usual ratios of those sums (``rel_l2 = √(Σ(q−x)²/Σx²)``, ``cosine = Σqx/√(Σq²Σx²)``), ratio
  estimators: the scale cancels within one call.  Where the reference is a float32 ``F.linear`` of CPU tensors
  (``QuantLinear``, torchao's ``Float8Linear``), the kept rows' reference is computed as it is compared, in one
  native pass (``qw_compare_linear_rows``): each element a float32 dot product summed in the build's vector lanes,
  so its last bits are not those of torch's matmul of the gathered rows (the figures agree to float32 rounding).
* **update_cosine.** A weight gradient is a sum over *all* tokens (``dYᵀX``), so a token subset of the reference
  could only be compared with the quantized path's gradient of the same tokens, which the training never computes.
  The gradient is sampled by its *rows* (output features) instead: the same fraction of them, drawn the same way;
  the reference computes ``dY[:, J]ᵀ X`` (``k/n`` of its cost) and is compared with the same rows ``J`` of the
  quantized path's gradient, which the training computed in full anyway; sums scaled by ``out/|J|`` as above.
  Both are made when that gradient arrives (the weight's hook), reference and comparison in one native pass on the
  CPU (``qw_compare_weight_grad_rows``).

Figures computed so are marked: :attr:`quantwatch.agent.StepRecord.estimated` names every metric of the step that
some layer estimated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quantwatch.agent.errors import ConfigError
from quantwatch.kernels.row_stats import RowsBuffer, stratified_rows

__all__ = ["SEED", "RowSampler", "RowSampling", "parse_shadow_rows"]

#: Base seed of the row draws (a layer's generator starts at ``SEED + its index``).
SEED = 0x5EED_0F_2025
# Host uniforms drawn at once (a sampled step of a 16-layer model takes ~500 for its two draws per layer at 1/8).
_UNIFORM_BLOCK = 4096
# Buffers a sampler keeps per pair of draw sizes (a layer called more often in a step draws into tensors of their own
# beyond them).
_BUFFERS_KEPT = 64


@dataclass(frozen=True)
class RowSampling:
    """How many rows ``shadow_rows`` keeps: a ``fraction`` (0 < f < 1) or a ``count`` (≥ 1), exactly one set."""

    fraction: float | None = None
    count: int | None = None

    def kept(self, n: int) -> int:
        """Rows kept of ``n`` (``n`` when all are)."""
        if self.count is not None:
            return min(self.count, n)
        fraction = 1.0 if self.fraction is None else self.fraction
        return min(n, max(1, math.ceil(fraction * n)))


def parse_shadow_rows(value: float | int | None) -> RowSampling | None:
    """``attach(shadow_rows=...)`` validated: None (or 1.0) = exact; raises ConfigError("shadow_rows") otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError("shadow_rows", f"must be a fraction 0 < f <= 1 or a row count >= 1, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError("shadow_rows", f"a row count must be >= 1, got {value!r}")
        return RowSampling(count=value)
    if not (0.0 < value <= 1.0):
        raise ConfigError("shadow_rows", f"a fraction must be in (0, 1], got {value!r}")
    return None if value == 1.0 else RowSampling(fraction=float(value))


class RowSampler:
    """One layer's seeded stratified draws: NumPy's generator for CPU tensors, a torch generator per other device."""

    def __init__(self, sampling: RowSampling, seed: int) -> None:
        self.sampling = sampling
        self.seed = seed
        self._host = np.random.default_rng(seed)
        # The host generator's uniforms, drawn a block at a time (the same stream as one `random(k)` per draw) and
        # consumed from `_next` on; `_address` is the block's.
        self._uniforms = np.empty(0)
        self._address = 0
        self._next = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._strata: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}
        # draw_layer's counts by its arguments: the tokens and the gradient's rows it draws (0: none, or all), and the
        # gradient's rows kept as `draw` takes them
        self._layer_counts: dict[tuple[int, bool, int | None], tuple[int, int, int]] = {}
        # draw_layer's host rows, written into buffers kept per pair of draw sizes: the first `_taken` of each list
        # hold rows handed out since the last `release`
        self._buffers: dict[tuple[int, int], list[RowsBuffer]] = {}
        self._taken: dict[tuple[int, int], int] = {}

    def draw(self, n: int, device: torch.device, kept: int | None = None) -> Tensor | None:
        """Sorted indices of the kept rows of ``n`` (``kept`` of them if given), on ``device``; None = all rows."""
        k = self.sampling.kept(n) if kept is None else min(kept, n)
        if k >= n:
            return None
        # Stratum j is rows [floor(j·n/k), floor((j+1)·n/k)); one uniform row of each.
        if device.type == "cpu":
            return self._host_draws(n, k, 0, 0)[0]
        strata = self._strata.get((n, k, device))
        if strata is None:
            edges = torch.arange(k + 1, device=device, dtype=torch.int64).mul_(n).div_(k, rounding_mode="floor")
            strata = (edges[:-1], edges[1:] - edges[:-1])
            self._strata[(n, k, device)] = strata
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = generator
        starts_t, sizes_t = strata
        offsets_t = torch.rand(k, generator=generator, device=device).mul_(sizes_t).long()
        return torch.minimum(offsets_t, sizes_t - 1).add_(starts_t)

    def draw_layer(
        self, n: int, output: bool, out_features: int | None, device: torch.device, grad_device: torch.device
    ) -> tuple[Tensor | None, Tensor | None]:
        """An ``nn.Linear`` call's draws, one after the other: its kept tokens of ``n`` on ``device`` when ``output``
        (``draw(n, device)``), then its weight gradient's kept rows of ``out_features`` on ``grad_device`` when given,
        the same share of them as of the tokens (``draw(out_features, grad_device, kept=...)``); None for a draw
        not made or of all rows.  On the host the same rows in one native call, into index tensors kept from step
        to step: they hold these rows until `release` (a sampled step draws for every layer, and each torch or NumPy
        call costs several microseconds there)."""
        counts = self._layer_counts.get((n, output, out_features))
        if counts is None:
            k, grad_kept, rows_of = self.sampling.kept(n), 0, out_features or 0
            if out_features is not None:
                grad_kept = min(out_features, max(1, math.ceil(out_features * self.fraction_of(n))))
            counts = (k if output and k < n else 0, grad_kept if grad_kept < rows_of else 0, grad_kept)
            self._layer_counts[(n, output, out_features)] = counts
        k, k2, grad_kept = counts
        if device.type == grad_device.type == "cpu":
            return self._host_draws(n, k, out_features or 0, k2, self._buffer(k, k2))
        rows = self.draw(n, device) if output else None
        return rows, (self.draw(out_features, grad_device, kept=grad_kept) if out_features is not None else None)

    def release(self) -> None:
        """The rows `draw_layer` handed out are used no more (their step was taken): their buffers take the next
        step's draws."""
        self._taken.clear()

    def _buffer(self, k: int, k2: int) -> RowsBuffer | None:
        """A buffer for draws of ``k`` and ``k2`` host rows that no rows handed out since `release` are in; None for
        draws of none, or past the buffers kept."""
        if not k + k2:
            return None
        key = (k, k2)
        taken = self._taken.get(key, 0)
        buffers = self._buffers.setdefault(key, [])
        if taken == len(buffers):
            if taken == _BUFFERS_KEPT:
                return None
            buffers.append(RowsBuffer.empty(k, k2))
        self._taken[key] = taken + 1
        return buffers[taken]

    def _host_draws(
        self, n: int, k: int, n2: int, k2: int, out: RowsBuffer | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """``k`` rows of ``n``, then ``k2`` of ``n2``, from the host generator's next ``k + k2`` uniforms (written into
        ``out`` when given)."""
        if not k + k2:
            return None, None
        start = self._next
        if start + k + k2 > self._uniforms.size:
            self._uniforms = np.concatenate([self._uniforms[start:], self._host.random(max(k + k2, _UNIFORM_BLOCK))])
            self._address = self._uniforms.ctypes.data
            start = 0
        self._next = start + k + k2
        return stratified_rows(self._uniforms, start, self._address, (n, k, n2, k2), out)

    def fraction_of(self, n: int) -> float:
        """The kept share of ``n`` rows (for the gradient's rows: the same share as the tokens')."""
        return self.sampling.kept(n) / n
