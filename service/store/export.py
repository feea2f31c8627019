"""Export of every stored point of a run with exact values: CSV, or Parquet streamed one row group at a time."""

from __future__ import annotations

import csv
import io
import math
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Layer, MetricName, Point, ScalarPoint
from quantwatch.service.rollups import is_missing, json_float, rows_from_blobs
from quantwatch.service.store.common import find_run

EXPORT_COLUMNS = ("rank", "step", "time", "kind", "name", "layer", "value")


class Exporter:
    """Streams of a run's points for one session factory."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory

    def _check(self, run: str) -> None:
        """Raise NotFoundError before a stream starts (afterwards the status line is sent)."""
        with self.factory() as session:
            find_run(session, run)

    def _export_rows(self, run: str, chunk_rows: int = 256) -> Iterator[tuple[list[Any], ...]]:
        """Yield column chunks (rank, step, time, kind, name, layer, value) of every stored point, exact values."""
        with self.factory() as session:
            r = find_run(session, run)
            layers = [n for (n,) in session.execute(select(Layer.name).where(Layer.run_id == r.id).order_by(Layer.idx))]
            names = dict(session.execute(select(MetricName.id, MetricName.name)).all())
            layer_arr = np.array(layers, dtype=object)
            result = session.execute(
                select(Point.rank, Point.step, Point.time, Point.name_id, Point.vals)
                .where(Point.run_id == r.id)
                .order_by(Point.rank, Point.step, Point.name_id)
                .execution_options(yield_per=chunk_rows)
            )
            for part in result.partitions():
                cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
                for rank, step, tm, nid, vals in part:
                    values = rows_from_blobs([bytes(vals)], len(layers))[0]
                    keep = ~is_missing(values)
                    k = int(keep.sum())
                    cols[0].extend([rank] * k)
                    cols[1].extend([step] * k)
                    cols[2].extend([tm] * k)
                    cols[3].extend(["metric"] * k)
                    cols[4].extend([names[nid]] * k)
                    cols[5].extend(layer_arr[keep].tolist())
                    cols[6].extend(values[keep].tolist())
                yield cols
            scal = session.execute(
                select(ScalarPoint.rank, ScalarPoint.step, ScalarPoint.time, ScalarPoint.name_id, ScalarPoint.value)
                .where(ScalarPoint.run_id == r.id)
                .order_by(ScalarPoint.rank, ScalarPoint.step, ScalarPoint.name_id)
                .execution_options(yield_per=chunk_rows * 64)
            )
            for part in scal.partitions():
                cols = ([], [], [], [], [], [], [])
                for rank, step, tm, nid, value in part:
                    cols[0].append(rank)
                    cols[1].append(step)
                    cols[2].append(tm)
                    cols[3].append("scalar")
                    cols[4].append(names[nid])
                    cols[5].append(None)
                    cols[6].append(struct.unpack("<d", value)[0])
                yield cols

    def export_csv(self, run: str) -> Iterator[bytes]:
        """CSV of every stored point (header first); float32 values printed exactly (round-trip)."""
        self._check(run)
        return self._csv(run)

    def _csv(self, run: str) -> Iterator[bytes]:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(EXPORT_COLUMNS)
        for cols in self._export_rows(run):
            writer.writerows(
                (
                    rank,
                    step,
                    "" if tm is None else repr(tm),
                    kind,
                    name,
                    layer or "",
                    json_float(v) if not math.isfinite(v) else repr(v),
                )
                for rank, step, tm, kind, name, layer, v in zip(*cols, strict=True)
            )
            yield buf.getvalue().encode()
            buf.seek(0)
            buf.truncate()
        if buf.tell():
            yield buf.getvalue().encode()

    def export_parquet(self, run: str) -> Iterator[bytes]:
        """Parquet of every stored point, written and streamed one row group per chunk (needs pyarrow)."""
        import pyarrow as pa  # optional dependency: the `parquet` extra
        import pyarrow.parquet as pq

        self._check(run)
        schema = pa.schema(
            [
                ("rank", pa.int32()),
                ("step", pa.int64()),
                ("time", pa.float64()),
                ("kind", pa.string()),
                ("name", pa.string()),
                ("layer", pa.string()),
                ("value", pa.float64()),
            ]
        )

        def generate() -> Iterator[bytes]:
            sink = _Sink()
            writer = pq.ParquetWriter(sink, schema)
            for cols in _merge_chunks(self._export_rows(run), 1 << 16):
                writer.write_table(pa.table(dict(zip(EXPORT_COLUMNS, cols, strict=True)), schema=schema))
                yield sink.take()
            writer.close()
            yield sink.take()

        return generate()


class _Sink(io.RawIOBase):
    """A write-only file collecting bytes until taken (for streaming a Parquet writer's output)."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._parts.append(chunk)
        self._pos += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def _merge_chunks(chunks: Iterable[tuple[list[Any], ...]], rows: int) -> Iterator[tuple[list[Any], ...]]:
    acc: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
    for cols in chunks:
        for a, c in zip(acc, cols, strict=True):
            a.extend(c)
        if len(acc[0]) >= rows:
            yield acc
            acc = ([], [], [], [], [], [], [])
    if acc[0]:
        yield acc
