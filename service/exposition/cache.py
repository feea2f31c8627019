"""The latest-value cache: latest value per exported series, fed a whole batch at a time, rendered off the ingest path.

Nothing on the ingest path calls ``Gauge.set`` per point: the cache takes a whole batch at once, with numpy, and keeps
its latest values per (run, rank) until the top-K merge, which runs off the ingest path with the rendering of the
sample lines of a (run, metric) that changed (by the background renderer between scrapes, or by the scrape itself for
whatever is left). Cardinality is bounded by design: per (run, metric) only the ``top_k`` worst layers are kept
(higher is worse, except for cosines and SQNR where lower is worse; non-finite values are the worst of all), the rest
is counted, and runs that send nothing for ``run_ttl_seconds`` drop out.

Deferring the merge (issue 21: it was a tenth of a one-step batch's CPU) coalesces the batches of one (run, rank) that
arrive between two merges: per layer the newest of them that measured it is merged, as if they had come as one batch
(a batch whose layer list differs from the waiting ones' merges them first). Two things follow,
both chosen: a value another rank's batch pushed out of the top-K while a newer batch of this rank was waiting is no
longer pushed out by the value that newer batch replaced (the slots hold the worst of the latest values, not of every
value seen between scrapes), and ``quantwatch_exposition_layer_values_omitted`` counts the values the cap leaves out
when they are merged, so a value replaced before its merge is neither exported nor counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from quantwatch.protocol import lower_is_worse
from quantwatch.service.exposition.naming import escape_label_value, layer_family_name
from quantwatch.service.float_text import float32_value_lines

__all__ = [
    "DEFAULT_RUN_TTL_SECONDS",
    "DEFAULT_TOP_K",
    "CacheSnapshot",
    "CachedRun",
    "Latest",
    "LatestValueCache",
    "LayerFamily",
    "Slot",
    "StepLike",
    "StepValues",
    "StoredRank",
    "WaitingValues",
    "slot_rows",
]

DEFAULT_TOP_K = 64
DEFAULT_RUN_TTL_SECONDS = 3600.0


class StepLike(Protocol):
    """One step of a batch as the cache reads it; :class:`quantwatch.service.batch.IngestStep` is one."""

    @property
    def step(self) -> int:
        """The optimizer step."""

    @property
    def metrics(self) -> Mapping[str, npt.NDArray[np.floating[Any]]]:
        """Per metric, one float per layer of the batch (NaN where not measured)."""

    @property
    def scalars(self) -> Mapping[str, float]:
        """Per-run scalars of the step."""

    @property
    def missing(self) -> Mapping[str, npt.NDArray[np.bool_]]:
        """Per metric with at least one null: True where the layer was not measured."""


@dataclass(frozen=True)
class StepValues:
    """A plain :class:`StepLike` (tests, benchmarks): the same fields as the ingest path's ``IngestStep``."""

    step: int
    metrics: Mapping[str, npt.NDArray[np.floating[Any]]]
    scalars: Mapping[str, float] = field(default_factory=dict)
    missing: Mapping[str, npt.NDArray[np.bool_]] = field(default_factory=dict)


@dataclass(frozen=True)
class StoredRank:
    """What the database holds of one (run, rank), as :meth:`LatestValueCache.restore` takes it after a restart.

    ``latest`` has, per metric, the value of each of ``layers`` at the newest step that measured it and which
    layers were measured at all; ``last_seen`` is the clock time of the run's newest batch (any rank).
    """

    run: str
    rank: int
    layers: tuple[str, ...]
    last_step: int
    last_seen: float
    latest: Mapping[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]]
    scalars: Mapping[str, float]


@dataclass
class Slot:
    """The exported layers of one (run, metric): at most K entries, sorted by (rank, layer id = model order).

    The entries are the columns of one (4, n) float64 array, rows rank, layer id, value and negated badness (what
    the top-K ranks: see :meth:`LatestValueCache._merge_all`), so that a merge moves them with one call, not four.
    Ranks and layer ids are small integers, exact in a float64.
    """

    entries: npt.NDArray[np.float64]
    omitted: int = 0
    text: bytes | None = None  # rendered sample lines; None until a scrape renders them after a change

    @property
    def ranks(self) -> npt.NDArray[np.int64]:
        """Rank of each entry."""
        return cast("npt.NDArray[np.int64]", self.entries[0].astype(np.int64))

    @property
    def layer_ids(self) -> npt.NDArray[np.int64]:
        """Layer id of each entry."""
        return cast("npt.NDArray[np.int64]", self.entries[1].astype(np.int64))

    @property
    def values(self) -> npt.NDArray[np.float64]:
        """Value of each entry: float32 figures widened; exported by their shortest float32 spelling."""
        return cast("npt.NDArray[np.float64]", self.entries[2])


Latest = dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_] | None]]
"""Per metric: the latest value of each of a batch's layers, and which of them were measured (None: all)."""


@dataclass
class WaitingValues:
    """The latest values of one (run, rank) that batches brought since its last merge into the slots.

    ``ids`` are the layer ids of the batches' layer list (one list: a batch with another merges these first);
    ``covers_all`` whether that list held every layer the run knew when they began to wait (layers the run learns
    later hold no entry of this rank, so its entries are all replaced when this was true).
    """

    ids: npt.NDArray[np.int64]
    covers_all: bool
    latest: Latest

    def take(self, latest: Latest) -> None:
        """Lay a newer batch's latest values over these: per layer, the newer value where the batch measured it."""
        for metric, (values, measured) in latest.items():
            current = self.latest.get(metric)
            if current is None or measured is None:
                self.latest[metric] = (values, measured)
                continue
            np.copyto(current[0], values, where=measured)
            if current[1] is not None:
                current[1][:] |= measured


@dataclass
class CachedRun:
    """Everything the cache holds for one run.

    Layers get a small integer id on first sight (so ids follow model order); the label text of each
    (rank, layer) is escaped once and kept, so a re-render only spells values.
    """

    name: str
    last_seen: float
    last_step: dict[int, int] = field(default_factory=dict)
    scalars: dict[tuple[str, int], float] = field(default_factory=dict)
    slots: dict[str, Slot] = field(default_factory=dict)
    layer_ids: dict[str, int] = field(default_factory=dict)
    layer_names: list[str] = field(default_factory=list)
    labels: dict[int, npt.NDArray[np.object_]] = field(default_factory=dict)  # rank -> label bytes by layer id
    last_layers: tuple[str, ...] = ()
    last_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    last_ids_cover_all: bool = False  # whether last_ids holds every layer the run has sent
    waiting: dict[int, WaitingValues] = field(default_factory=dict)  # by rank: latest values not merged into the slots

    def ids_of(self, layers: Sequence[str]) -> npt.NDArray[np.int64]:
        """Ids of ``layers``, registering new ones; a batch with the same layer list as the last costs a compare."""
        key = tuple(layers)
        if key != self.last_layers:
            for name in key:
                if name not in self.layer_ids:
                    self.layer_ids[name] = len(self.layer_names)
                    self.layer_names.append(name)
            self.last_layers = key
            self.last_ids = np.fromiter((self.layer_ids[n] for n in key), dtype=np.int64, count=len(key))
            # Registration only happens here, so while the list stays the same this stays true or false.
            self.last_ids_cover_all = len(set(key)) == len(self.layer_names)
        return self.last_ids

    def label_texts(self, rank: int) -> npt.NDArray[np.object_]:
        """``{layer="…",rank="…",run="…"} `` (up to the value) of every known layer for ``rank``, by layer id.

        An object array, so that a slot's labels are one gather in C rather than a lookup per line.
        """
        texts = self.labels.get(rank)
        if texts is None or len(texts) < len(self.layer_names):
            known: list[bytes] = [] if texts is None else texts.tolist()
            run = escape_label_value(self.name)
            known.extend(
                f'{{layer="{escape_label_value(layer)}",rank="{rank}",run="{run}"}} '.encode()
                for layer in self.layer_names[len(known) :]
            )
            texts = self.labels[rank] = np.array(known, dtype=object)
        return texts


@dataclass(frozen=True)
class LayerFamily:
    """A snapshot of one layer gauge family: the rendered lines of every run, in run order."""

    name: str
    metric: str
    chunks: tuple[tuple[CachedRun, Slot], ...]


@dataclass(frozen=True)
class CacheSnapshot:
    """What one scrape reads from the cache, taken under its lock."""

    layer_families: tuple[LayerFamily, ...]
    run_scalars: tuple[tuple[str, int, str, float], ...]  # (run, rank, scalar, value)
    last_steps: tuple[tuple[str, int, int], ...]  # (run, rank, step)
    last_seen: tuple[tuple[str, float], ...]  # (run, clock seconds)
    omitted_series: tuple[tuple[str, int], ...]  # (metric, layer series not exported now)
    omitted_values_total: int
    expired_runs_total: int


class LatestValueCache:
    """Latest value per exported series, fed a whole batch at a time; thread-safe.

    Per (run, metric) it keeps the ``top_k`` worst layers across ranks (the exposition's cardinality cap); per
    (run, rank) the last step and the latest scalars. Work per batch is O(layers) numpy, a few calls per metric;
    nothing is rendered on the ingest path (see :meth:`render_changed` and :meth:`snapshot`). ``clock`` is
    injectable so tests can freeze time.
    """

    def __init__(
        self,
        *,
        top_k: int = DEFAULT_TOP_K,
        run_ttl_seconds: float = DEFAULT_RUN_TTL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an integer ≥ 1, got {top_k!r}")
        if not isinstance(run_ttl_seconds, (int, float)) or not run_ttl_seconds > 0:
            raise ValueError(f"run_ttl_seconds must be a number > 0, got {run_ttl_seconds!r}")
        self.top_k = top_k
        self.run_ttl_seconds = float(run_ttl_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, CachedRun] = {}
        self._changed_runs: set[str] = set()  # runs with slots a batch changed since a render
        self.scraped_at: float | None = None  # time.monotonic() of the last snapshot
        self._omitted_values_total = 0
        self._expired_runs_total = 0

    def observe(self, run: str, rank: int, layers: Sequence[str], steps: Iterable[StepLike]) -> None:
        """Take one stored batch of (run, rank): the latest value of every layer and scalar in it.

        A batch whose newest step is older than the newest already seen for (run, rank) is history, not the
        present: it leaves the latest values alone. The last step and the scalars are current at once; the layer
        values wait for the next merge (:meth:`render_changed` or :meth:`snapshot`: see the module's docstring).
        """
        ordered = sorted(steps, key=lambda s: s.step)
        if not ordered:
            return
        latest = _latest_per_layer(ordered, len(layers))
        newest_step = ordered[-1].step
        now = self._clock()
        with self._lock:
            state = self._runs.get(run)
            if state is None:
                state = self._runs[run] = CachedRun(name=run, last_seen=now)
            state.last_seen = now
            if newest_step < state.last_step.get(rank, -1):
                return
            state.last_step[rank] = newest_step
            for s in ordered:
                for scalar, value in s.scalars.items():
                    state.scalars[(scalar, rank)] = float(value)
            ids = state.ids_of(layers)
            waiting = state.waiting.get(rank)
            if waiting is not None and np.array_equal(waiting.ids, ids):
                waiting.take(latest)
            else:
                if waiting is not None:
                    self._merge_waiting(state, rank, waiting)
                state.waiting[rank] = WaitingValues(ids, state.last_ids_cover_all, latest)
            self._changed_runs.add(run)

    def restore(self, stored: StoredRank) -> bool:
        """Take what the database holds of one (run, rank) after a restart; returns whether it was taken.

        A (run, rank) that a batch reached the cache for first is left alone: ingest is newer than any read of the
        database, so a restore running next to ingest never puts an older value over a newer one. The values of a
        restored (run, rank) compete for the top-K like those of a batch; what the cap leaves out is not counted
        as left out of ingested batches (``quantwatch_exposition_layer_values_omitted``).
        """
        with self._lock:
            state = self._runs.get(stored.run)
            if state is None:
                state = self._runs[stored.run] = CachedRun(name=stored.run, last_seen=stored.last_seen)
            elif stored.rank in state.last_step:
                return False
            self._merge_run(state)
            state.last_step[stored.rank] = stored.last_step
            for scalar, value in stored.scalars.items():
                state.scalars[(scalar, stored.rank)] = value
            latest = {
                metric: (values, None if measured.all() else measured)
                for metric, (values, measured) in stored.latest.items()
            }
            ids = state.ids_of(stored.layers)
            self._merge_all(state, stored.rank, ids, latest, state.last_ids_cover_all)
            self._changed_runs.add(stored.run)
            return True

    def _merge_run(self, state: CachedRun) -> None:
        """Merge every rank's waiting values of ``state`` into its slots, in the order they began waiting."""
        for rank, waiting in state.waiting.items():
            self._merge_waiting(state, rank, waiting)
        state.waiting.clear()

    def _merge_waiting(self, state: CachedRun, rank: int, waiting: WaitingValues) -> None:
        """Merge one rank's waiting values into the slots, counting what the cap leaves out of them."""
        self._omitted_values_total += self._merge_all(state, rank, waiting.ids, waiting.latest, waiting.covers_all)

    def _merge_all(
        self,
        state: CachedRun,
        rank: int,
        ids: npt.NDArray[np.int64],
        latest: Latest,
        covers_all: bool,
    ) -> int:
        """Merge one rank's latest values of every metric into their slots; returns how many the cap left out.

        ``covers_all``: ``ids`` hold every layer the run knows now. The per-batch work is done once for all metrics
        (the entries and badness of every value in one pass, which layers the rank re-sent), so that what is left per
        metric is the few numpy calls of the top-K itself.
        """
        if not latest or ids.size == 0:
            return 0
        metrics = list(latest)
        entries = np.empty((len(metrics), 4, ids.size))
        entries[:, 0] = rank
        entries[:, 1] = ids
        entries[:, 2] = [latest[m][0] for m in metrics]
        # Negated badness: higher is worse except for cosines and SQNR; NaN is the worst of all.
        neg = entries[:, 3]
        np.multiply(entries[:, 2], np.array([1.0 if lower_is_worse(m) else -1.0 for m in metrics])[:, None], out=neg)
        neg[np.isnan(neg)] = -np.inf
        resent: npt.NDArray[np.bool_] | None = None  # by layer id: the batch holds it (made once, when needed)
        dropped = 0
        for row, metric in enumerate(metrics):
            measured = latest[metric][1]
            if measured is not None:
                remeasured = np.zeros(len(state.layer_names), dtype=np.bool_)
                remeasured[ids[measured]] = True
                dropped += self._merge(state, metric, rank, entries[row][:, measured], remeasured)
                continue
            if resent is None and not covers_all:
                resent = np.zeros(len(state.layer_names), dtype=np.bool_)
                resent[ids] = True
            # resent None: the batch holds every layer the run knows, so all of this rank's entries are replaced
            dropped += self._merge(state, metric, rank, entries[row], resent)
        return dropped

    def _merge(
        self,
        state: CachedRun,
        metric: str,
        rank: int,
        new: npt.NDArray[np.float64],
        remeasured: npt.NDArray[np.bool_] | None,
    ) -> int:
        """Merge one rank's new entries into the (run, metric) slot; returns how many of them the cap left out.

        ``remeasured`` is True by layer id where the rank re-sent the layer (None: every layer); the rank's old
        entries of those layers are replaced, everything else stays a candidate. Which candidates survive is
        exactly what one argpartition over [old kept entries, new entries] picks, so ties go as they always did.
        """
        size = int(new.shape[1])
        if size == 0:
            return 0
        old = state.slots.get(metric)
        if old is None:
            entries = new
        else:
            mine = old.entries[0] == rank
            if not np.count_nonzero(mine):
                entries = np.concatenate([old.entries, new], axis=1)
            else:
                if remeasured is not None:
                    mine &= remeasured[old.entries[1].astype(np.int64)]
                entries = np.concatenate([old.entries.compress(~mine, axis=1), new], axis=1)
        omitted = dropped = 0
        total = entries.shape[1]
        if total > self.top_k:
            chosen = np.argpartition(entries[3], self.top_k - 1)[: self.top_k]
            omitted = total - self.top_k
            dropped = size - int(np.count_nonzero(chosen >= total - size))
            entries = entries.take(chosen, axis=1)
        state.slots[metric] = Slot(entries.take(np.lexsort((entries[1], entries[0])), axis=1), omitted)
        return dropped

    def run_names(self) -> set[str]:
        """Names of the runs the cache holds now."""
        with self._lock:
            return set(self._runs)

    def expire(self) -> int:
        """Drop runs idle longer than the TTL; returns how many went."""
        deadline = self._clock() - self.run_ttl_seconds
        with self._lock:
            return self._expire_locked(deadline)

    def _expire_locked(self, deadline: float) -> int:
        stale = [run for run, state in self._runs.items() if state.last_seen < deadline]
        for run in stale:
            del self._runs[run]
        self._expired_runs_total += len(stale)
        return len(stale)

    def render_changed(self, runs_per_hold: int = 8) -> int:
        """Merge the values batches left waiting and render the slots they changed; returns how many it rendered.

        The :class:`BackgroundRenderer` calls this between scrapes, so that a scrape finds most slots merged and
        rendered. The lock is held for one (run, rank)'s merge, then for the rendering of ``runs_per_hold`` runs at a
        time: ingest and a scrape wait for one small pass at most. Runs changed while it works are left to the next
        call (or to the scrape).
        """
        with self._lock:
            todo, self._changed_runs = sorted(self._changed_runs), set()
        rendered = 0
        for first in range(0, len(todo), runs_per_hold):
            for run in todo[first : first + runs_per_hold]:
                self._merge_waiting_of(run)
            with self._lock:
                changed = [
                    (layer_family_name(metric), state, slot)
                    for state in (self._runs.get(run) for run in todo[first : first + runs_per_hold])
                    if state is not None
                    for metric, slot in state.slots.items()
                    if slot.text is None
                ]
                for (_, _, slot), text in zip(changed, _render_slots(changed), strict=True):
                    slot.text = text
            rendered += len(changed)
        return rendered

    def _merge_waiting_of(self, run: str) -> None:
        """Merge the waiting values of ``run``, one rank per hold of the lock: ingest waits for one merge at most
        (a run of 64 ranks would hold it for 64 otherwise). Ranks that begin to wait meanwhile are left to the next
        call, or to the scrape."""
        with self._lock:
            state = self._runs.get(run)
            count = 0 if state is None else len(state.waiting)
        for _ in range(count):
            with self._lock:
                state = self._runs.get(run)
                if state is None or not state.waiting:
                    return
                rank = next(iter(state.waiting))  # the one waiting longest
                self._merge_waiting(state, rank, state.waiting.pop(rank))

    def snapshot(self) -> CacheSnapshot:
        """Expire idle runs, merge the values batches left waiting, render changed slots and return what a scrape
        exports: every batch acknowledged before the call is in it."""
        deadline = self._clock() - self.run_ttl_seconds
        with self._lock:
            self.scraped_at = time.monotonic()
            self._expire_locked(deadline)
            runs = sorted(self._runs.items())
            by_metric: dict[str, list[tuple[CachedRun, Slot]]] = {}
            scalars: list[tuple[str, int, str, float]] = []
            steps: list[tuple[str, int, int]] = []
            seen: list[tuple[str, float]] = []
            omitted: dict[str, int] = {}
            changed: list[tuple[str, CachedRun, Slot]] = []
            for run, state in runs:
                self._merge_run(state)
                for metric, slot in state.slots.items():
                    if slot.text is None:
                        changed.append((layer_family_name(metric), state, slot))
                    by_metric.setdefault(metric, []).append((state, slot))
                    omitted[metric] = omitted.get(metric, 0) + slot.omitted
                scalars.extend((run, rank, name, value) for (name, rank), value in sorted(state.scalars.items()))
                steps.extend((run, rank, step) for rank, step in sorted(state.last_step.items()))
                seen.append((run, state.last_seen))
            for (_, _, slot), text in zip(changed, _render_slots(changed), strict=True):
                slot.text = text
            self._changed_runs.clear()  # everything is rendered now
            families = tuple(
                LayerFamily(layer_family_name(metric), metric, tuple(chunks))
                for metric, chunks in sorted(by_metric.items(), key=lambda item: layer_family_name(item[0]))
            )
            return CacheSnapshot(
                layer_families=families,
                run_scalars=tuple(scalars),
                last_steps=tuple(steps),
                last_seen=tuple(seen),
                omitted_series=tuple(sorted(omitted.items())),
                omitted_values_total=self._omitted_values_total,
                expired_runs_total=self._expired_runs_total,
            )


def _latest_per_layer(steps: Sequence[StepLike], n_layers: int) -> Latest:
    """Per metric: the value of each layer at the newest step that measured it, and which layers any step measured
    (None: all of them, the common case, which then costs no mask)."""
    latest: Latest = {}
    for s in steps:
        for metric, raw in s.metrics.items():
            values = np.array(raw, dtype=np.float64)  # a copy: later steps are written into it
            if values.shape != (n_layers,):
                raise ValueError(f"metrics.{metric} has {values.size} values for {n_layers} layers")
            missing = s.missing.get(metric)
            current = latest.get(metric)
            if missing is None:  # every layer measured: this newer step replaces whatever came before
                latest[metric] = (values, None)
                continue
            measured = ~np.asarray(missing, dtype=np.bool_)
            if current is None:
                values[~measured] = np.nan
                latest[metric] = (values, measured)
            else:
                np.copyto(current[0], values, where=measured)
                if current[1] is not None:
                    current[1][:] |= measured
    return latest


def _render_slots(slots: Sequence[tuple[str, CachedRun, Slot]]) -> list[bytes]:
    """The sample lines of each (family, run, slot), byte for byte as prometheus_client's text format writes them.

    The values of every slot that changed since the last scrape are spelled in one vectorised pass; per slot its
    lines are one join of pieces that already exist (family, cached label text, value line).
    """
    if not slots:
        return []
    values = float32_value_lines(np.concatenate([slot.values for _, _, slot in slots]))
    out = []
    start = 0
    for family, state, slot in slots:
        count = slot.values.size
        pieces = [family.encode(), b"", b""] * count
        pieces[1::3] = _slot_labels(state, slot)
        pieces[2::3] = values[start : start + count]
        out.append(b"".join(pieces))
        start += count
    return out


def _slot_labels(state: CachedRun, slot: Slot) -> list[bytes]:
    """Label text of each entry of a slot."""
    first, last = slot.entries[0, 0], slot.entries[0, -1]
    if first == last:  # sorted by rank: one rank throughout
        return cast("list[bytes]", state.label_texts(int(first))[slot.layer_ids].tolist())
    ranks = slot.ranks.tolist()
    texts = {rank: state.label_texts(rank) for rank in set(ranks)}
    return [texts[rank][layer] for rank, layer in zip(ranks, slot.layer_ids.tolist(), strict=True)]


def slot_rows(state: CachedRun, slot: Slot) -> Iterator[tuple[int, str, float]]:
    """(rank, layer, value) rows of a slot, each value the float of its shortest float32 spelling (numpy's)."""
    texts = slot.values.astype(np.float32).astype(np.str_).tolist()
    for rank, layer, text in zip(slot.ranks.tolist(), slot.layer_ids.tolist(), texts, strict=True):
        yield rank, state.layer_names[layer], float(text)
