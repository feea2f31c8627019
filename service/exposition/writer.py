"""The text writer: gauge families that write their own sample lines, and :func:`render_exposition`.

Byte for byte what prometheus_client's ``generate_latest`` writes (a test holds them equal), much faster: the layer
gauges come pre-rendered from the cache, the small gauges are formatted straight from their rows; counters, the
histogram and the build info go through prometheus_client itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from quantwatch.service.exposition.cache import LayerFamily, slot_rows
from quantwatch.service.exposition.naming import go_float, row_prefix

__all__ = ["CONTENT_TYPE", "FastFamily", "LayerGaugeFamily", "RowsGaugeFamily", "render_exposition"]

# What render_exposition writes: the classic text format, which every Prometheus version reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FastFamily(Metric, ABC):
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


class LayerGaugeFamily(FastFamily):
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
            for rank, layer, value in slot_rows(state, slot)
        ]


class RowsGaugeFamily(FastFamily):
    """A small gauge family (per run, per rule…) formatted straight from its rows, without Sample objects."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str],
        rows: Iterable[tuple[Sequence[str], float]] = (),
    ) -> None:
        super().__init__(name, documentation)
        self._labels = tuple(labels)
        self._rows: list[tuple[tuple[str, ...], float]] = [(tuple(values), float(value)) for values, value in rows]

    def add(self, values: Sequence[str], value: float) -> None:
        """Add one sample with label ``values`` in the order of the family's label names."""
        self._rows.append((tuple(values), float(value)))

    def rendered(self) -> list[bytes]:
        """The sample lines, in the order the rows were added."""
        name, labels = self.name, self._labels
        return [
            "".join([f"{row_prefix(name, labels, values)}{go_float(value)}\n" for values, value in self._rows]).encode()
        ]

    def build_samples(self) -> list[Sample]:
        """Samples of the rows."""
        return [
            Sample(self.name, dict(zip(self._labels, values, strict=True)), value, None, None, None)
            for values, value in self._rows
        ]


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
        if isinstance(metric, FastFamily):
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            header = f"# HELP {metric.name} {doc}\n# TYPE {metric.name} gauge\n"
            parts.append(header.encode())
            parts.extend(metric.rendered())
        else:
            parts.append(generate_latest(_Single(metric)))
    return b"".join(parts)
