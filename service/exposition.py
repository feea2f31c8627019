"""Prometheus exposition of the collector: a latest-value cache, one custom collector, and ``GET /metrics``.

Layers import downward, as in prometheus/client_python: the :class:`LatestValueCache` knows nothing of Prometheus
beyond the names it renders; :class:`QuantWatchCollector` turns the cache (and the alert streaks) into metric
families on the app's own :class:`~prometheus_client.CollectorRegistry`; :func:`render_exposition` writes the text
format. Nothing on the ingest path calls ``Gauge.set`` per point: the cache takes a whole batch at once, with numpy,
and the sample lines of a (run, metric) are rendered after it changed, off the ingest path: by the
:class:`BackgroundRenderer` between scrapes, or by the scrape itself for whatever is left.

Cardinality is bounded by design: per (run, metric) only the ``top_k`` worst layers are exported (higher is worse,
except for cosines and SQNR where lower is worse; non-finite values are the worst of all), the rest is counted, and
runs that send nothing for ``run_ttl_seconds`` drop out.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import numpy.typing as npt
from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from quantwatch import __version__
from quantwatch.protocol import CATALOG, lower_is_worse
from quantwatch.service.api.deps import ReadAuth
from quantwatch.service.float_text import float32_value_lines

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from quantwatch.service.batch import IngestBatch
    from quantwatch.service.models import Run

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_RENDER_IDLE_AFTER_SECONDS",
    "DEFAULT_RENDER_INTERVAL_SECONDS",
    "DEFAULT_RUN_TTL_SECONDS",
    "DEFAULT_TOP_K",
    "LAYER_METRIC_FAMILIES",
    "RUN_SCALAR_FAMILIES",
    "AlertSeries",
    "AlertSeriesSource",
    "BackgroundRenderer",
    "DeliveryCounts",
    "Exposition",
    "IngestMetrics",
    "IngestTimingMiddleware",
    "LatestValueCache",
    "PrometheusObserver",
    "QuantWatchCollector",
    "StepLike",
    "StepValues",
    "alert_series_source",
    "delivery_counts",
    "install_exposition",
    "layer_family_name",
    "render_exposition",
    "run_family_name",
]

# The text format's spelling of a float (+Inf, NaN, Go-style exponents); prometheus_client leaves it untyped.
_go_float = cast("Callable[[float], str]", floatToGoString)

# What render_exposition writes: the classic text format, which every Prometheus version reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_TOP_K = 64
DEFAULT_RUN_TTL_SECONDS = 3600.0
# How often the background renderer renders what batches changed: it bounds the renderer's work per second whatever
# the batch rate, and how much a scrape can find left to render when batches arrive steadily.
DEFAULT_RENDER_INTERVAL_SECONDS = 0.25
# The renderer works only while someone scrapes: not at all until the first scrape, nor after this long without one.
DEFAULT_RENDER_IDLE_AFTER_SECONDS = 300.0

log = logging.getLogger("quantwatch.exposition")

# Canonical metric → exported gauge family, from the protocol's catalogue.
LAYER_METRIC_FAMILIES: Mapping[str, str] = {m.name: m.family for m in CATALOG.values() if m.scope == "layer"}

RUN_SCALAR_FAMILIES: Mapping[str, str] = {m.name: m.family for m in CATALOG.values() if m.scope == "run"}

# A custom name that spells a canonical family (or one of the collector's own) must not merge into it.
_CANONICAL_FAMILIES = frozenset(
    [
        *LAYER_METRIC_FAMILIES.values(),
        *RUN_SCALAR_FAMILIES.values(),
        "quantwatch_run_last_step",
        "quantwatch_run_last_ingest_timestamp_seconds",
    ]
)
_RESERVED_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created", "_info")
_NOT_NAME_CHARS = re.compile(r"[^a-z0-9_]")


def _family_name(canonical: Mapping[str, str], prefix: str, name: str) -> str:
    """The family of ``name``: its canonical one, else ``prefix`` + its snake case (no reserved suffix), marked
    ``_custom`` where that would collide with a canonical family."""
    known = canonical.get(name)
    if known is not None:
        return known
    cleaned = _NOT_NAME_CHARS.sub("_", name.lower()).strip("_") or "unnamed"
    if cleaned.endswith(_RESERVED_SUFFIXES):
        cleaned += "_value"
    family = prefix + cleaned
    return family + "_custom" if family in _CANONICAL_FAMILIES else family


def layer_family_name(metric: str) -> str:
    """The exported gauge family of a per-layer metric: ``output_rel_l2`` → ``quantwatch_layer_output_rel_l2_ratio``."""
    return _family_name(LAYER_METRIC_FAMILIES, "quantwatch_layer_", metric)


def run_family_name(scalar: str) -> str:
    """The exported gauge family of a per-run scalar, e.g. ``loss`` → ``quantwatch_run_loss``."""
    return _family_name(RUN_SCALAR_FAMILIES, "quantwatch_run_", scalar)


@functools.lru_cache(maxsize=1 << 16)
def _escape_label_value(value: str) -> str:
    # The text format's escaping, byte for byte what prometheus_client writes. Memoised: the same run, layer and rule
    # names come back in every scrape.
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@functools.lru_cache(maxsize=1 << 16)
def _row_prefix(family: str, names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """``family{name="value",…} `` with the label names sorted, as the text format writes them. Memoised: the same
    run, rank, rule and layer rows come back in every scrape."""
    labels = ",".join(
        f'{name}="{_escape_label_value(value)}"' for name, value in sorted(zip(names, values, strict=True))
    )
    return f"{family}{{{labels}}} "


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


@dataclass
class _Slot:
    """The exported layers of one (run, metric): at most K entries, sorted by (rank, layer id = model order)."""

    ranks: npt.NDArray[np.int64]
    layer_ids: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]  # float32 figures widened; exported by their shortest float32 spelling
    omitted: int = 0
    text: bytes | None = None  # rendered sample lines; None until a scrape renders them after a change


@dataclass
class _Run:
    """Everything the cache holds for one run.

    Layers get a small integer id on first sight (so ids follow model order); the label text of each
    (rank, layer) is escaped once and kept, so a re-render only spells values.
    """

    name: str
    last_seen: float
    last_step: dict[int, int] = field(default_factory=dict)
    scalars: dict[tuple[str, int], float] = field(default_factory=dict)
    slots: dict[str, _Slot] = field(default_factory=dict)
    layer_ids: dict[str, int] = field(default_factory=dict)
    layer_names: list[str] = field(default_factory=list)
    labels: dict[int, npt.NDArray[np.object_]] = field(default_factory=dict)  # rank -> label bytes by layer id
    last_layers: tuple[str, ...] = ()
    last_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

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
        return self.last_ids

    def label_texts(self, rank: int) -> npt.NDArray[np.object_]:
        """``{layer="…",rank="…",run="…"} `` (up to the value) of every known layer for ``rank``, by layer id.

        An object array, so that a slot's labels are one gather in C rather than a lookup per line.
        """
        texts = self.labels.get(rank)
        if texts is None or len(texts) < len(self.layer_names):
            known: list[bytes] = [] if texts is None else texts.tolist()
            run = _escape_label_value(self.name)
            known.extend(
                f'{{layer="{_escape_label_value(layer)}",rank="{rank}",run="{run}"}} '.encode()
                for layer in self.layer_names[len(known) :]
            )
            texts = self.labels[rank] = np.array(known, dtype=object)
        return texts


@dataclass(frozen=True)
class LayerFamily:
    """A snapshot of one layer gauge family: the rendered lines of every run, in run order."""

    name: str
    metric: str
    chunks: tuple[tuple[_Run, _Slot], ...]


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
    (run, rank) the last step and the latest scalars. Work per batch is O(layers) numpy per metric; nothing is
    rendered on the ingest path (see :meth:`render_changed` and :meth:`snapshot`). ``clock`` is injectable so tests
    can freeze time.
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
        self._runs: dict[str, _Run] = {}
        self._changed_runs: set[str] = set()  # runs with slots a batch changed since a render
        self.scraped_at: float | None = None  # time.monotonic() of the last snapshot
        self._omitted_values_total = 0
        self._expired_runs_total = 0

    def observe(self, run: str, rank: int, layers: Sequence[str], steps: Iterable[StepLike]) -> None:
        """Take one stored batch of (run, rank): the latest value of every layer and scalar in it.

        A batch whose newest step is older than the newest already seen for (run, rank) is history, not the
        present: it leaves the latest values alone.
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
                state = self._runs[run] = _Run(name=run, last_seen=now)
            state.last_seen = now
            if newest_step < state.last_step.get(rank, -1):
                return
            state.last_step[rank] = newest_step
            for s in ordered:
                for scalar, value in s.scalars.items():
                    state.scalars[(scalar, rank)] = float(value)
            ids = state.ids_of(layers)
            for metric, (values, measured) in latest.items():
                self._merge(state, metric, rank, ids[measured], values[measured])
            self._changed_runs.add(run)

    def _merge(
        self,
        state: _Run,
        metric: str,
        rank: int,
        ids: npt.NDArray[np.int64],
        values: npt.NDArray[np.float64],
    ) -> None:
        if ids.size == 0:
            return
        old = state.slots.get(metric)
        if old is None:
            ranks, layer_ids, vals = np.full(ids.size, rank, dtype=np.int64), ids, values
        else:
            # Entries of this rank that the batch measured again are replaced; everything else stays a candidate.
            remeasured = np.zeros(len(state.layer_names), dtype=np.bool_)
            remeasured[ids] = True
            keep = (old.ranks != rank) | ~remeasured[old.layer_ids]
            ranks = np.concatenate([old.ranks[keep], np.full(ids.size, rank, dtype=np.int64)])
            layer_ids = np.concatenate([old.layer_ids[keep], ids])
            vals = np.concatenate([old.values[keep], values])
        omitted = 0
        if vals.size > self.top_k:
            badness = np.where(np.isnan(vals), np.inf, -vals if lower_is_worse(metric) else vals)
            chosen = np.argpartition(-badness, self.top_k - 1)[: self.top_k]
            omitted = vals.size - self.top_k
            kept = np.zeros(vals.size, dtype=np.bool_)
            kept[chosen] = True
            self._omitted_values_total += ids.size - int(np.count_nonzero(kept[-ids.size :]))
            ranks, layer_ids, vals = ranks[chosen], layer_ids[chosen], vals[chosen]
        order = np.lexsort((layer_ids, ranks))
        state.slots[metric] = _Slot(ranks[order], layer_ids[order], vals[order], omitted)

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
        """Render the slots that batches changed since they were last rendered; returns how many it rendered.

        The :class:`BackgroundRenderer` calls this between scrapes, so that a scrape finds most slots rendered. The
        lock is held for ``runs_per_hold`` runs at a time: ingest and a scrape wait for one small pass at most.
        Runs changed while it works are left to the next call (or to the scrape).
        """
        with self._lock:
            todo, self._changed_runs = sorted(self._changed_runs), set()
        rendered = 0
        for first in range(0, len(todo), runs_per_hold):
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

    def snapshot(self) -> CacheSnapshot:
        """Expire idle runs, render changed slots and return what a scrape exports."""
        deadline = self._clock() - self.run_ttl_seconds
        with self._lock:
            self.scraped_at = time.monotonic()
            self._expire_locked(deadline)
            runs = sorted(self._runs.items())
            by_metric: dict[str, list[tuple[_Run, _Slot]]] = {}
            scalars: list[tuple[str, int, str, float]] = []
            steps: list[tuple[str, int, int]] = []
            seen: list[tuple[str, float]] = []
            omitted: dict[str, int] = {}
            changed: list[tuple[str, _Run, _Slot]] = []
            for run, state in runs:
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


class BackgroundRenderer:
    """A daemon thread rendering the slots that batches changed, between scrapes, every ``interval_seconds``.

    A scrape then only renders what changed since the last pass, so its time no longer grows with how many runs sent
    a batch since the previous scrape; it still renders whatever is left, so its answer is never stale. The work per
    second is bounded by the interval, not by the batch rate: a slot that ten batches changed between two passes is
    rendered once. Nothing is rendered ahead until the first scrape or after ``idle_after_seconds`` without one (a
    collector nobody scrapes spends nothing). ``cpu_seconds`` and ``slots_rendered`` say what it cost.
    """

    def __init__(
        self,
        cache: LatestValueCache,
        interval_seconds: float = DEFAULT_RENDER_INTERVAL_SECONDS,
        idle_after_seconds: float = DEFAULT_RENDER_IDLE_AFTER_SECONDS,
    ) -> None:
        for name, value in (("interval_seconds", interval_seconds), ("idle_after_seconds", idle_after_seconds)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.cache = cache
        self.interval_seconds = float(interval_seconds)
        self.idle_after_seconds = float(idle_after_seconds)
        self.cpu_seconds = 0.0
        self.slots_rendered = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name="quantwatch-exposition", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the pass in progress."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():  # kept while it runs on: a later start() must not add a second thread
                self._thread = None

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval_seconds):
            scraped_at = self.cache.scraped_at
            if scraped_at is None or time.monotonic() - scraped_at > self.idle_after_seconds:
                continue
            started = time.thread_time()
            try:
                self.slots_rendered += self.cache.render_changed()
            except Exception:  # a scrape renders what is left (and reports the error itself)
                if not self._failed:
                    log.exception("background rendering of the exposition failed; scrapes render instead")
                    self._failed = True
            self.cpu_seconds += time.thread_time() - started


def _latest_per_layer(
    steps: Sequence[StepLike], n_layers: int
) -> dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]]:
    """Per metric: the value of each layer at the newest step that measured it, and which layers any step measured."""
    latest: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]] = {}
    for s in steps:
        for metric, raw in s.metrics.items():
            values = np.asarray(raw, dtype=np.float64)
            if values.shape != (n_layers,):
                raise ValueError(f"metrics.{metric} has {values.size} values for {n_layers} layers")
            missing = s.missing.get(metric)
            measured = np.ones(n_layers, dtype=np.bool_) if missing is None else ~np.asarray(missing, dtype=np.bool_)
            current = latest.get(metric)
            if current is None:
                latest[metric] = (np.where(measured, values, np.nan), measured.copy())
            else:
                np.copyto(current[0], values, where=measured)
                current[1][:] |= measured
    return latest


def _render_slots(slots: Sequence[tuple[str, _Run, _Slot]]) -> list[bytes]:
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


def _slot_labels(state: _Run, slot: _Slot) -> list[bytes]:
    """Label text of each entry of a slot."""
    if slot.ranks[0] == slot.ranks[-1]:  # sorted by rank: one rank throughout
        return cast("list[bytes]", state.label_texts(int(slot.ranks[0]))[slot.layer_ids].tolist())
    ranks = slot.ranks.tolist()
    texts = {rank: state.label_texts(rank) for rank in set(ranks)}
    return [texts[rank][layer] for rank, layer in zip(ranks, slot.layer_ids.tolist(), strict=True)]


def _slot_rows(state: _Run, slot: _Slot) -> Iterator[tuple[int, str, float]]:
    """(rank, layer, value) rows of a slot, each value the float of its shortest float32 spelling (numpy's)."""
    texts = slot.values.astype(np.float32).astype(np.str_).tolist()
    for rank, layer, text in zip(slot.ranks.tolist(), slot.layer_ids.tolist(), texts, strict=True):
        yield rank, state.layer_names[layer], float(text)


class _FastFamily(Metric, ABC):
    """A gauge family that writes its own sample lines.

    :func:`render_exposition` writes ``rendered()`` directly; any other consumer of the registry reads ``samples``,
    built on demand from the same data, so both see the same values (a test holds the bytes equal to
    prometheus_client's own writer).
    """

    def __init__(self, name: str, documentation: str) -> None:
        super().__init__(name, documentation, "gauge")

    @abstractmethod
    def rendered(self) -> list[bytes]:
        """The sample lines of the family, in pieces to be concatenated."""

    @abstractmethod
    def build_samples(self) -> list[Sample]:
        """The samples of the family, for the generic path."""

    @property
    def samples(self) -> list[Sample]:
        """Samples built on demand (the slow, generic path)."""
        return self.build_samples()

    @samples.setter
    def samples(self, _value: list[Sample]) -> None:
        # Metric.__init__ assigns an empty list; the samples of these families always come from their data.
        return


class _LayerGaugeFamily(_FastFamily):
    """A layer gauge family: the cached sample lines of every run's (run, metric) slot."""

    def __init__(self, family: LayerFamily, documentation: str) -> None:
        super().__init__(family.name, documentation)
        self._family = family

    def rendered(self) -> list[bytes]:
        """The sample lines of every run, as rendered by the cache (joined once, with the whole exposition)."""
        return [slot.text or b"" for _, slot in self._family.chunks]

    def build_samples(self) -> list[Sample]:
        """Samples built from the cached arrays."""
        return [
            Sample(self._family.name, {"run": state.name, "rank": str(rank), "layer": layer}, value, None, None, None)
            for state, slot in self._family.chunks
            for rank, layer, value in _slot_rows(state, slot)
        ]


class _RowsGaugeFamily(_FastFamily):
    """A small gauge family (per run, per rule…) formatted straight from its rows, without Sample objects."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation)
        self._labels = tuple(labels)
        self._rows: list[tuple[tuple[str, ...], float]] = []

    def add(self, values: Sequence[str], value: float) -> None:
        """Add one sample with label ``values`` in the order of the family's label names."""
        self._rows.append((tuple(values), float(value)))

    def rendered(self) -> list[bytes]:
        """The sample lines, in the order the rows were added."""
        name, labels = self.name, self._labels
        return [
            "".join(
                [f"{_row_prefix(name, labels, values)}{_go_float(value)}\n" for values, value in self._rows]
            ).encode()
        ]

    def build_samples(self) -> list[Sample]:
        """Samples of the rows."""
        return [
            Sample(self.name, dict(zip(self._labels, values, strict=True)), value, None, None, None)
            for values, value in self._rows
        ]


@dataclass(frozen=True)
class AlertSeries:
    """The alert state of one (rule, run, layer) series, as the alert evaluator keeps it.

    ``layer`` is empty for rules on run scalars. ``state`` is one of inactive, pending, firing, resolved.
    """

    rule: str
    run: str
    layer: str
    streak_steps: int
    state: str


class AlertSeriesSource(Protocol):
    """Anything that lists the current alert series (the alert evaluator's store)."""

    def __call__(self) -> Iterable[AlertSeries]:
        """Return the series whose streak is non-zero or whose state is pending or firing."""
        ...


_EXPORTED_ALERT_STATES = ("pending", "firing")
_STATE_RANK = {"inactive": 0, "resolved": 0, "pending": 1, "firing": 2}
DELIVERY_STATUSES = ("pending", "delivered", "failed", "cancelled")

DeliveryCounts = Callable[[], Mapping[str, int]]
"""Number of outbox deliveries per status (pending, delivered, failed, cancelled)."""


class SeriesSnapshotLike(Protocol):
    """One evaluator series as :meth:`AlertEngine.latest_series` returns it (per rank)."""

    @property
    def rule(self) -> str:
        """Rule name."""

    @property
    def run(self) -> str:
        """Run name."""

    @property
    def layer(self) -> str:
        """Layer ('' for scalar rules)."""

    @property
    def status(self) -> str:
        """inactive, pending or firing."""

    @property
    def streak(self) -> int:
        """Consecutive breaching reported steps."""


class AlertEngineLike(Protocol):
    """The alert evaluator, as far as the exposition reads it."""

    def latest_series(self) -> Sequence[SeriesSnapshotLike]:
        """Streak and status of every series this process evaluated."""
        ...


def alert_series_source(engine: AlertEngineLike) -> AlertSeriesSource:
    """Alert series of the evaluator's in-memory state, one per (rule, run, layer) across ranks.

    The streak exported is the longest of the ranks and the state the most severe, matching the evaluator's
    episodes, which are per (rule, run, layer) however many ranks breach.
    """

    def source() -> list[AlertSeries]:
        merged: dict[tuple[str, str, str], tuple[int, str]] = {}
        for snap in engine.latest_series():
            if snap.streak <= 0 and snap.status not in _EXPORTED_ALERT_STATES:
                continue
            key = (snap.rule, snap.run, snap.layer)
            streak, state = merged.get(key, (0, "inactive"))
            if _STATE_RANK.get(snap.status, 0) > _STATE_RANK.get(state, 0):
                state = snap.status
            merged[key] = (max(streak, snap.streak), state)
        return [AlertSeries(rule, run, layer, streak, state) for (rule, run, layer), (streak, state) in merged.items()]

    return source


def delivery_counts(sessions: sessionmaker[Session]) -> DeliveryCounts:
    """Outbox deliveries per status, read from the database (an index-only count) at scrape time."""
    from sqlalchemy import func, select

    from quantwatch.service.alerts.tables import DeliveryRow

    def count() -> Mapping[str, int]:
        with sessions() as session:
            rows = session.execute(select(DeliveryRow.status, func.count()).group_by(DeliveryRow.status))
            return {str(status): int(total) for status, total in rows}

    return count


class QuantWatchCollector(Collector):
    """The one custom collector: layer and run gauges from the cache, alert streaks and states, cap counters."""

    def __init__(
        self,
        cache: LatestValueCache,
        ingest: IngestMetrics | None = None,
        alerts: AlertSeriesSource | None = None,
        deliveries: DeliveryCounts | None = None,
    ) -> None:
        self.cache = cache
        self.ingest = ingest if ingest is not None else IngestMetrics()
        self.alerts = alerts
        self.deliveries = deliveries

    def collect(self) -> Iterator[Metric]:
        """Yield every family of a scrape, in a stable order."""
        snap = self.cache.snapshot()
        for family in snap.layer_families:
            yield _LayerGaugeFamily(
                family, f"Latest {family.metric} of the worst layers of each run (top-K per run and metric)."
            )
        scalars: dict[str, _RowsGaugeFamily] = {}
        for run, rank, scalar, value in snap.run_scalars:
            name = run_family_name(scalar)
            if name not in scalars:
                scalars[name] = _RowsGaugeFamily(name, f"Latest {scalar} of each run.", ["run", "rank"])
            scalars[name].add([run, str(rank)], value)
        yield from (scalars[name] for name in sorted(scalars))
        last_step = _RowsGaugeFamily(
            "quantwatch_run_last_step", "Newest step ingested for each run and rank.", ["run", "rank"]
        )
        for run, rank, step in snap.last_steps:
            last_step.add([run, str(rank)], step)
        yield last_step
        last_seen = _RowsGaugeFamily(
            "quantwatch_run_last_ingest_timestamp_seconds",
            "Unix time of the newest batch ingested for each run.",
            ["run"],
        )
        for run, seen in snap.last_seen:
            last_seen.add([run], seen)
        yield last_seen
        omitted_series = _RowsGaugeFamily(
            "quantwatch_exposition_layer_series_omitted",
            "Layer series known to the cache but not exported because of the top-K cap, per metric.",
            ["metric"],
        )
        for metric, count in snap.omitted_series:
            omitted_series.add([metric], count)
        yield omitted_series
        yield CounterMetricFamily(
            "quantwatch_exposition_layer_values_omitted",
            "Latest layer values of ingested batches that the top-K cap left out of the exposition.",
            value=snap.omitted_values_total,
        )
        yield CounterMetricFamily(
            "quantwatch_exposition_runs_expired",
            "Runs dropped from the exposition after sending nothing for the TTL.",
            value=snap.expired_runs_total,
        )
        yield from self._alert_families({run for run, _ in snap.last_seen})
        yield from self.ingest.families()
        yield InfoMetricFamily(
            "quantwatch_build",
            "QuantWatch collector build.",
            value={"version": __version__},
        )

    def _alert_families(self, active_runs: set[str]) -> Iterator[Metric]:
        """Streaks and states of the runs the cache still exports, at most ``top_k`` series per (rule, run): the
        longest streaks, and every pending or firing alert among them first."""
        streaks = _RowsGaugeFamily(
            "quantwatch_alert_streak_steps",
            "Consecutive breaching steps of each (rule, run, layer) series with a non-zero streak.",
            ["rule", "run", "layer"],
        )
        states = _RowsGaugeFamily(
            "quantwatch_alert_state",
            "1 for each (rule, run, layer) alert that is pending or firing.",
            ["rule", "run", "layer", "state"],
        )
        by_rule_run: dict[tuple[str, str], list[AlertSeries]] = {}
        for alert in self.alerts() if self.alerts is not None else ():
            if alert.run in active_runs:
                by_rule_run.setdefault((alert.rule, alert.run), []).append(alert)
        top_k = self.cache.top_k
        kept = [
            alert
            for group in by_rule_run.values()
            for alert in sorted(group, key=lambda a: (-_STATE_RANK.get(a.state, 0), -a.streak_steps, a.layer))[:top_k]
        ]
        for alert in sorted(kept, key=lambda a: (a.rule, a.run, a.layer)):
            if alert.streak_steps > 0:
                streaks.add([alert.rule, alert.run, alert.layer], alert.streak_steps)
            if alert.state in _EXPORTED_ALERT_STATES:
                states.add([alert.rule, alert.run, alert.layer, alert.state], 1)
        yield streaks
        yield states
        if self.deliveries is not None:
            counts = self.deliveries()
            deliveries = _RowsGaugeFamily(
                "quantwatch_alert_deliveries",
                "Alert notifications in the outbox by status (pending, delivered, failed, cancelled).",
                ["status"],
            )
            for status in DELIVERY_STATUSES:
                deliveries.add([status], counts.get(status, 0))
            yield deliveries


class IngestMetrics:
    """Request-level figures of the ingest path: a few additions per request under a lock, never work per point.

    Kept as plain numbers rather than prometheus_client instruments so that the exposition carries no ``_created``
    samples and is byte-for-byte reproducible under a frozen clock.
    """

    OUTCOMES = ("accepted", "duplicate", "rejected", "throttled", "error")
    DURATION_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.points_total = 0
        self.requests_total = dict.fromkeys(self.OUTCOMES, 0)
        self._bucket_counts = [0] * (len(self.DURATION_BUCKETS_SECONDS) + 1)
        self._duration_sum_seconds = 0.0

    def observe_points(self, points: int) -> None:
        """Count points stored by one committed batch."""
        with self._lock:
            self.points_total += points

    def observe_request(self, status_code: int, seconds: float, *, duplicate: bool = False) -> None:
        """Count one answered ingest request by outcome and record its latency."""
        if status_code < 300:
            outcome = "duplicate" if duplicate else "accepted"
        elif status_code in (429, 503):
            outcome = "throttled"
        elif status_code < 500:
            outcome = "rejected"
        else:
            outcome = "error"
        with self._lock:
            self.requests_total[outcome] += 1
            self._bucket_counts[bisect.bisect_left(self.DURATION_BUCKETS_SECONDS, seconds)] += 1
            self._duration_sum_seconds += seconds

    def families(self) -> Iterator[Metric]:
        """The ingest counters and the latency histogram as metric families."""
        with self._lock:
            points = self.points_total
            requests = dict(self.requests_total)
            counts = list(self._bucket_counts)
            total_seconds = self._duration_sum_seconds
        yield CounterMetricFamily(
            "quantwatch_ingest_points", "Points stored by ingest (one value of one series at one step).", value=points
        )
        by_outcome = CounterMetricFamily(
            "quantwatch_ingest_requests",
            "Ingest requests by outcome: accepted, duplicate, rejected (4xx), throttled (429/503), error (5xx).",
            labels=["outcome"],
        )
        for outcome in self.OUTCOMES:
            by_outcome.add_metric([outcome], requests[outcome])
        yield by_outcome
        cumulative = list(itertools.accumulate(counts))
        bounds = [_go_float(b) for b in self.DURATION_BUCKETS_SECONDS] + ["+Inf"]
        yield HistogramMetricFamily(
            "quantwatch_ingest_request_duration_seconds",
            "Time to answer an ingest request.",
            buckets=list(zip(bounds, cumulative, strict=True)),
            sum_value=total_seconds,
        )


class _Single:
    """A one-family collector, so prometheus_client's own writer renders the small families."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterable[Metric]:
        return (self._metric,)


def render_exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition (version 0.0.4) of ``registry``: identical bytes to ``generate_latest``, much faster.

    Gauge families write their own lines (the layer gauges come pre-rendered from the cache); counters, the
    histogram and the build info go through prometheus_client.
    """
    parts: list[bytes] = []
    for metric in registry.collect():
        if isinstance(metric, _FastFamily):
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            header = f"# HELP {metric.name} {doc}\n# TYPE {metric.name} gauge\n"
            parts.append(header.encode())
            parts.extend(metric.rendered())
        else:
            parts.append(generate_latest(_Single(metric)))
    return b"".join(parts)


class PrometheusObserver:
    """The ingest observer that feeds the exposition: latest values and the points counter, after commit.

    Nothing happens inside the ingest transaction, so the exposition only ever shows committed data.
    """

    def __init__(self, cache: LatestValueCache, ingest: IngestMetrics) -> None:
        self.cache = cache
        self.ingest = ingest

    def on_batch(self, session: Session, run_row: Run, batch: IngestBatch) -> None:
        """Nothing to do inside the transaction."""

    def after_commit(self, batch: IngestBatch) -> None:
        """Take the committed batch's latest values and count its points."""
        self.cache.observe(batch.run, batch.rank, batch.layers, batch.steps)
        self.ingest.observe_points(batch.points)


class IngestTimingMiddleware:
    """ASGI middleware timing ``POST /api/v1/ingest`` and counting its outcome; every other request passes through.

    The ingest route marks a duplicate batch in the request state (``ingest_duplicate``).
    """

    def __init__(self, app: ASGIApp, metrics: IngestMetrics, path: str = "/api/v1/ingest") -> None:
        self.app = app
        self.metrics = metrics
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI request."""
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            duplicate = bool(scope.get("state", {}).get("ingest_duplicate", False))
            self.metrics.observe_request(status, time.perf_counter() - started, duplicate=duplicate)


@dataclass(frozen=True)
class Exposition:
    """The exposition parts of one app: its own registry, the cache, the ingest figures and the collector."""

    registry: CollectorRegistry
    cache: LatestValueCache
    ingest: IngestMetrics
    collector: QuantWatchCollector
    renderer: BackgroundRenderer

    def render(self) -> bytes:
        """The text exposition of the app's registry."""
        return render_exposition(self.registry)


def install_exposition(
    app: FastAPI,
    *,
    top_k: int = DEFAULT_TOP_K,
    run_ttl_seconds: float = DEFAULT_RUN_TTL_SECONDS,
    alerts: AlertSeriesSource | None = None,
    deliveries: DeliveryCounts | None = None,
    clock: Callable[[], float] = time.time,
    render_interval_seconds: float = DEFAULT_RENDER_INTERVAL_SECONDS,
) -> Exposition:
    """Give ``app`` its ``GET /metrics``: a registry of its own, the cache as an ingest observer, ingest timing.

    The app's lifespan starts and stops ``exposition.renderer`` (the background renderer).
    """
    cache = LatestValueCache(top_k=top_k, run_ttl_seconds=run_ttl_seconds, clock=clock)
    ingest = IngestMetrics()
    collector = QuantWatchCollector(cache, ingest, alerts, deliveries)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    renderer = BackgroundRenderer(cache, render_interval_seconds)
    exposition = Exposition(registry, cache, ingest, collector, renderer)
    app.state.exposition = exposition
    app.state.ingest_observers.append(PrometheusObserver(cache, ingest))
    app.add_middleware(IngestTimingMiddleware, metrics=ingest)

    @app.get(
        "/metrics",
        tags=["health"],
        response_class=Response,
        dependencies=[ReadAuth],
        responses={
            200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format 0.0.4"},
            401: {"description": "Missing or unknown bearer token (when tokens are configured)"},
            403: {"description": "The token lacks the read scope"},
        },
    )
    def metrics() -> Response:
        """Prometheus exposition: latest values of the worst layers per run and metric, run scalars, alert
        streaks and states, ingest counters and latency. Needs a read-scope token when tokens are configured
        (Prometheus sends it with ``authorization: credentials_file``)."""
        return Response(exposition.render(), media_type=CONTENT_TYPE)

    return exposition
