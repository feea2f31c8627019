"""Export of every stored point of a run with exact values: CSV, or Parquet streamed one row group at a time."""

from __future__ import annotations

import csv
import io
import math
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.models import Layer, MetricName, RunMetric, RunRank, ScalarPoint
from quantwatch.service.rollups import F32, F64, I64, is_missing, json_float
from quantwatch.service.store.common import find_run
from quantwatch.service.store.raw_points import RawPoints

EXPORT_COLUMNS = ("rank", "step", "time", "kind", "name", "layer", "value")


class Exporter:
    """Streams of a run's points for one session factory."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self.points = RawPoints()

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
            conn = session.connection()
            ranks = session.execute(
                select(RunRank.rank, RunRank.first_step, RunRank.last_step)
                .where(RunRank.run_id == r.id)
                .order_by(RunRank.rank)
            ).all()
            nids = sorted(
                int(n)
                for (n,) in session.execute(
                    select(RunMetric.name_id).where(RunMetric.run_id == r.id, RunMetric.kind == "layer")
                )
            )
            for rank, first, last in ranks:
                for w_steps, w_times, w_ids, values in self._rank_points(
                    conn, r.id, rank, nids, first, last, len(layers), chunk_rows
                ):
                    cols: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
                    for i in range(len(w_steps)):
                        row = values[i]
                        keep = ~is_missing(row)
                        k = int(keep.sum())
                        cols[0].extend([rank] * k)
                        cols[1].extend([int(w_steps[i])] * k)
                        cols[2].extend([None if np.isnan(w_times[i]) else float(w_times[i])] * k)
                        cols[3].extend(["metric"] * k)
                        cols[4].extend([names[int(w_ids[i])]] * k)
                        cols[5].extend(layer_arr[keep].tolist())
                        cols[6].extend(row[keep].tolist())
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

    def _rank_points(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        nids: list[int],
        first: int,
        last: int,
        width: int,
        chunk_rows: int,
    ) -> Iterator[tuple[I64, F64, I64, F32]]:
        """The rank's points in (step, metric) order, in windows of steps holding about ``chunk_rows`` rows each:
        (steps, times, name ids, values (rows × ``width``, the run's layers)) per window."""
        if not nids:
            return  # a run of scalars only has no layer points (concatenating nothing raised mid-stream)
        lo, span = first, chunk_rows
        while lo <= last:
            hi = min(last, lo + span - 1)
            found = [
                (
                    nid,
                    self.points.read(
                        conn, {"run_id": run_id, "rank": rank, "nid": nid}, lo, hi, None, width, times=True
                    ),
                )
                for nid in nids
            ]
            steps = np.concatenate([f.steps for _, f in found])
            ids = np.concatenate([np.full(f.steps.size, nid, dtype=np.int64) for nid, f in found])
            order = np.lexsort((ids, steps))
            if order.size:
                times = np.concatenate([f.times for _, f in found if f.times is not None])
                values = np.concatenate([f.values for _, f in found])
                yield steps[order], times[order], ids[order], values[order]
            # About chunk_rows rows per window, whatever the density of sampled steps.
            span = max(1, min(span * 4, int(span * chunk_rows / max(order.size, 1))))
            lo = hi + 1

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
