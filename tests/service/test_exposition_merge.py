"""The latest-value cache's batched merge against the per-metric merge it replaced (issue 21).

The reference below is that merge written out plainly: per metric, this rank's re-sent entries leave, the batch's
measured values join, one argpartition over [kept, new] keeps the top-K worst. The cache merges every metric of a
batch in one pass with shortcuts for the common cases; its slots and counters must be the reference's exactly,
ties included (values are drawn from a small set with NaN and ±inf, so ties at the cap's edge are frequent).

The cache merges off the ingest path, at a scrape or a background render: the batches of one (run, rank) that wait
for it are merged as one batch of all their steps (the reference's ``observe_waiting``), a batch of another layer
list merging the waiting ones first.
"""

from __future__ import annotations

import numpy as np
import pytest

from quantwatch.protocol import lower_is_worse
from quantwatch.service.exposition import LatestValueCache, StepValues

LAYERS = [f"layer{i}" for i in range(24)]
METRICS = ["output_rel_l2", "output_cosine", "weight_sqnr_db"]
CHOICES = np.array([0.0, 0.25, 0.5, 1.0, 2.0, np.nan, np.inf, -np.inf, 0.125, 4.0])


class ReferenceCache:
    """The per-metric merge, one (run, metric) slot at a time, as entries (rank, layer id, value)."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.layer_ids: dict[str, int] = {}
        self.slots: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}
        self.omitted_total = 0
        self.waiting: dict[int, tuple[list[str], list[StepValues]]] = {}

    def observe_waiting(self, rank: int, layers: list[str], steps: list[StepValues]) -> None:
        """Keep a batch until :meth:`merge_waiting`, with the rank's waiting ones when they have the same layers."""
        self.register(layers)
        waiting = self.waiting.get(rank)
        if waiting is not None and waiting[0] == layers:
            waiting[1].extend(steps)
            return
        if waiting is not None:
            self.observe(rank, *waiting)
        self.waiting[rank] = (layers, list(steps))

    def merge_waiting(self) -> None:
        for rank, (layers, steps) in self.waiting.items():
            self.observe(rank, layers, steps)
        self.waiting.clear()

    def register(self, layers: list[str]) -> None:
        for name in layers:
            self.layer_ids.setdefault(name, len(self.layer_ids))

    def observe(self, rank: int, layers: list[str], steps: list[StepValues]) -> None:
        self.register(layers)
        ids = np.array([self.layer_ids[n] for n in layers], dtype=np.int64)
        latest: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for s in sorted(steps, key=lambda s: s.step):
            for metric, raw in s.metrics.items():
                measured = ~s.missing.get(metric, np.zeros(len(layers), dtype=np.bool_))
                values, seen = latest.setdefault(metric, (np.full(len(layers), np.nan), np.zeros(len(layers), bool)))
                values[measured] = np.asarray(raw, dtype=np.float64)[measured]
                seen |= measured
        for metric, (values, seen) in latest.items():
            self.omitted_total += self.merge(metric, rank, ids[seen], values[seen])

    def merge(self, metric: str, rank: int, ids: np.ndarray, values: np.ndarray) -> int:
        if ids.size == 0:
            return 0
        ranks = np.full(ids.size, rank, dtype=np.int64)
        if metric in self.slots:
            old_ranks, old_ids, old_values, _ = self.slots[metric]
            resent = set(ids.tolist())
            keep = np.array([not (r == rank and i in resent) for r, i in zip(old_ranks, old_ids, strict=True)], bool)
            ranks = np.concatenate([old_ranks[keep], ranks])
            ids_all = np.concatenate([old_ids[keep], ids])
            values = np.concatenate([old_values[keep], values])
        else:
            ids_all = ids
        omitted = dropped = 0
        if values.size > self.top_k:
            badness = np.where(np.isnan(values), np.inf, -values if lower_is_worse(metric) else values)
            chosen = np.argpartition(-badness, self.top_k - 1)[: self.top_k]
            omitted = values.size - self.top_k
            dropped = ids.size - int(np.count_nonzero(chosen >= values.size - ids.size))
            ranks, ids_all, values = ranks[chosen], ids_all[chosen], values[chosen]
        order = np.lexsort((ids_all, ranks))
        self.slots[metric] = (ranks[order], ids_all[order], values[order], omitted)
        return dropped


def random_batch(rng: np.random.Generator, step: int) -> tuple[list[str], list[StepValues]]:
    """A batch of 1-3 steps over a random layer set (often all layers, in model order, as agents send them)."""
    if rng.random() < 0.5:
        layers = list(LAYERS)
    else:
        chosen = rng.choice(len(LAYERS), size=int(rng.integers(1, len(LAYERS))), replace=False)
        layers = [LAYERS[i] for i in (sorted(chosen) if rng.random() < 0.5 else chosen)]
    steps = []
    for offset in range(int(rng.integers(1, 4))):
        metrics, missing = {}, {}
        for metric in METRICS:
            if rng.random() < 0.15:
                continue
            metrics[metric] = rng.choice(CHOICES, size=len(layers)).astype(np.float32)
            if rng.random() < 0.3:
                missing[metric] = rng.random(len(layers)) < 0.4
                metrics[metric][missing[metric]] = np.nan
        steps.append(StepValues(step=step + offset, metrics=metrics, missing=missing))
    return layers, steps


def assert_same_slots(cache: LatestValueCache, reference: ReferenceCache) -> None:
    """After a snapshot (which merges what waits): the cache's slots and counter are the reference's."""
    omitted_total = cache.snapshot().omitted_values_total
    state = cache._runs["run"]
    assert state.layer_names == list(reference.layer_ids)
    assert set(state.slots) == set(reference.slots)
    for metric, slot in state.slots.items():
        ranks, ids, values, omitted = reference.slots[metric]
        np.testing.assert_array_equal(slot.ranks, ranks)
        np.testing.assert_array_equal(slot.layer_ids, ids)
        np.testing.assert_array_equal(slot.values, values)
        assert slot.omitted == omitted
    assert omitted_total == reference.omitted_total


@pytest.mark.parametrize("seed", range(6))
def test_batched_merge_equals_the_per_metric_merge(seed: int) -> None:
    rng = np.random.default_rng(seed)
    top_k = int(rng.integers(1, 12))
    cache, reference = LatestValueCache(top_k=top_k), ReferenceCache(top_k)
    step = 0
    for _ in range(150):
        rank = int(rng.integers(0, 4))
        layers, steps = random_batch(rng, step)
        step += 3
        cache.observe("run", rank, layers, steps)
        reference.observe(rank, layers, steps)
        assert_same_slots(cache, reference)


@pytest.mark.parametrize("seed", range(6))
def test_batches_waiting_for_a_merge_merge_as_one_batch_of_their_steps(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    top_k = int(rng.integers(1, 12))
    cache, reference = LatestValueCache(top_k=top_k), ReferenceCache(top_k)
    step = merges = 0
    for _ in range(300):
        rank = int(rng.integers(0, 4))
        layers, steps = random_batch(rng, step)
        step += 3
        cache.observe("run", rank, layers, steps)
        reference.observe_waiting(rank, layers, steps)
        if rng.random() < 0.15:
            reference.merge_waiting()
            assert_same_slots(cache, reference)
            merges += 1
    assert merges > 20
