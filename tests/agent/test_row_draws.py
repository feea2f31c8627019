"""The row draws of ``shadow_rows`` keep the rows NumPy's per-draw generator gave: the same seeded stream, drawn a
block ahead, and the same stratified rows, whether drawn one by one (`RowSampler.draw`) or a layer's two at once
(`RowSampler.draw_layer`), on the host with the native kernels or without them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantwatch.agent.rows import RowSampler, RowSampling
from quantwatch.kernels import native

CPU = torch.device("cpu")


class _PerDrawRows:
    """The draws as agent/rows.py made them before: ``random(k)`` of the layer's generator per draw."""

    def __init__(self, sampling: RowSampling, seed: int) -> None:
        self.sampling = sampling
        self.rng = np.random.default_rng(seed)

    def draw(self, n: int, kept: int | None = None) -> list[int] | None:
        k = self.sampling.kept(n) if kept is None else min(kept, n)
        if k >= n:
            return None
        bounds = np.arange(k + 1, dtype=np.int64) * n // k
        sizes = bounds[1:] - bounds[:-1]
        return (bounds[:-1] + np.minimum((self.rng.random(k) * sizes).astype(np.int64), sizes - 1)).tolist()

    def draw_layer(self, n: int, output: bool, out_features: int | None) -> tuple[list[int] | None, ...]:
        rows = self.draw(n) if output else None
        if out_features is None:
            return rows, None
        kept = min(out_features, max(1, math.ceil(out_features * self.sampling.kept(n) / n)))
        return rows, self.draw(out_features, kept=kept)


def _listed(rows: torch.Tensor | None) -> list[int] | None:
    return None if rows is None else rows.tolist()


@pytest.mark.parametrize("loaded", [True, False])
@pytest.mark.parametrize("sampling", [RowSampling(fraction=1 / 8), RowSampling(fraction=0.3), RowSampling(count=5)])
def test_draws_keep_the_rows_of_numpys_per_draw_stream(
    loaded: bool, sampling: RowSampling, monkeypatch: pytest.MonkeyPatch
) -> None:
    if loaded and not native.available():
        pytest.skip("native kernels unavailable")
    if not loaded:
        monkeypatch.setattr(native, "loaded", lambda: None)
    sampler, expected = RowSampler(sampling, seed=11), _PerDrawRows(sampling, seed=11)
    # Enough draws to run through several blocks of uniforms, of calls of different sizes, some keeping every row.
    calls = [(128, True, 768), (128, False, 256), (4, True, 3), (1024, True, None), (128, True, 1024), (3, False, 2)]
    for step in range(300):
        n, output, out_features = calls[step % len(calls)]
        got = sampler.draw_layer(n, output, out_features, CPU, CPU)
        assert tuple(_listed(r) for r in got) == expected.draw_layer(n, output, out_features), step
        assert _listed(sampler.draw(n + step % 7, CPU)) == expected.draw(n + step % 7), step


def test_rows_handed_out_hold_until_released_and_their_buffers_then_take_the_next_steps_draws() -> None:
    if not native.available():
        pytest.skip("native kernels unavailable")
    native.prepare()
    sampler, expected = RowSampler(RowSampling(fraction=1 / 8), seed=5), _PerDrawRows(RowSampling(fraction=1 / 8), 5)
    # One layer called three times in a step: each call's rows stay what they were drawn as until the step is taken.
    step = [sampler.draw_layer(128, True, 768, CPU, CPU) for _ in range(3)]
    drawn = [expected.draw_layer(128, True, 768) for _ in range(3)]
    assert [tuple(_listed(r) for r in pair) for pair in step] == drawn
    sampler.release()
    again = sampler.draw_layer(128, True, 768, CPU, CPU)
    assert tuple(_listed(r) for r in again) == expected.draw_layer(128, True, 768)
    pointers = [None if r is None else r.data_ptr() for r in (*step[0], *again)]
    # The next step's first draw is written where the last step's first was: no tensor made per draw.
    assert None not in pointers
    assert pointers[:2] == pointers[2:]
    assert tuple(_listed(r) for r in step[1]) == drawn[1]
