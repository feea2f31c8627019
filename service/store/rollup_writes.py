"""Rollup maintenance behind the ingest path: the blocks of every level brought up to date for given steps.

Two rules keep the table small (issue 21). A block above the base level is written once it is complete (it ends at or
before the rank's frontier): reads use only such blocks, so a partial one would be rewritten at every compaction for
nothing (on PostgreSQL each rewrite leaves a dead tuple). And a block that holds fewer than
:data:`MIN_BLOCK_SAMPLES` samples is not stored at all: its 18 bytes per layer would cost more than the samples
themselves in a chunk (1-step batches of every 10th step put 6.4 samples in a 64-step block), and a read of that
width takes those steps from the raw points instead, which for so few samples costs about what the block would.
A parent block is combined from its children where every child is stored (or was computed in the same pass), else
from the raw points of its steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, select

from quantwatch.service.models import Rollup, RunRank
from quantwatch.service.rollup_codec import decode_blocks, encode_blocks
from quantwatch.service.rollups import F32, I64, LEVELS, Partials, group_starts
from quantwatch.service.store.raw_points import RawPoints

MIN_BLOCK_SAMPLES = 16
"""Fewest samples (of its best-measured layer) a rollup block must hold to be stored."""

Blocks = dict[int, tuple[I64, Partials]]
"""Blocks of one level by name id: bucket indexes (sorted) and their partials."""


_RAW_FROM = select(RunRank.raw_from_step).where(
    RunRank.run_id == bindparam("run_id"), RunRank.rank == bindparam("rank")
)


def read_raw_from(conn: Connection, run_id: int, rank: int) -> int:
    """The rank's ``raw_from_step``: where retention dropped its raw points up to (0: nothing dropped, or no such
    rank)."""
    return int(conn.execute(_RAW_FROM, {"run_id": run_id, "rank": rank}).scalar_one_or_none() or 0)


def stored_blocks(keys: I64, part: Partials) -> I64:
    """Indexes of the blocks among ``keys`` that hold enough samples to be stored."""
    counts = part.vcount.max(axis=1) if part.vcount.shape[1] else np.zeros(keys.size, dtype=np.int64)
    return np.flatnonzero(counts >= MIN_BLOCK_SAMPLES)


class RollupWriter:
    """Reads and upserts rollup blocks inside a transaction (statements built once per store)."""

    def __init__(self, insert: Callable[..., Any], points: RawPoints) -> None:
        self.points = points
        rollup = insert(Rollup)
        # Built once: constructing and cache-keying Core statements per batch cost more than executing them.
        self._upsert = rollup.on_conflict_do_update(
            index_elements=["run_id", "rank", "name_id", "level", "bucket"],
            set_={"stats": rollup.excluded.stats},
        )
        self._select = (
            select(Rollup.name_id, Rollup.bucket, Rollup.stats)
            .where(
                Rollup.run_id == bindparam("run_id"),
                Rollup.rank == bindparam("rank"),
                Rollup.name_id.in_(bindparam("nids", expanding=True)),
                Rollup.level == bindparam("level"),
                Rollup.bucket >= bindparam("lo"),
                Rollup.bucket <= bindparam("hi"),
            )
            .order_by(Rollup.name_id, Rollup.bucket)
        )

    def read(
        self, conn: Connection, run_id: int, rank: int, nids: Sequence[int], level: int, lo: int, hi: int, n_layers: int
    ) -> Blocks:
        """Stored blocks of ``level`` with bucket in [lo, hi] for each of ``nids``, by name id, bucket order."""
        rows = conn.execute(
            self._select,
            {"run_id": run_id, "rank": rank, "nids": list(nids), "level": level, "lo": lo, "hi": hi},
        ).all()
        out: Blocks = {}
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][0] != rows[start][0]:
                chunk = rows[start:i]
                out[int(rows[start][0])] = (
                    np.array([r[1] for r in chunk], dtype=np.int64),
                    decode_blocks([r[2] for r in chunk], n_layers),
                )
                start = i
        return out

    def write(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        matrices: dict[int, tuple[I64, F32]],
        replaced: set[int],
        n_layers: int,
        complete_before: int,
    ) -> None:
        """Bring every rollup level up to date for the given steps, all metrics at once per level.

        For a name id in ``replaced`` the touched base blocks are recomputed from the raw points (written first);
        for the others the values are the whole content of their blocks (the compactor's case: it read them from raw).
        Blocks above the base level are written only where they end at or before ``complete_before`` (the frontier).
        """
        base = LEVELS[0]
        contents = {nid: matrix for nid, matrix in matrices.items() if nid not in replaced}
        redo = [nid for nid in matrices if nid in replaced]
        if redo:
            # Replaced values cannot be subtracted from a min or max: the touched blocks recomputed from raw, every
            # replaced metric's read together (behind the frontier, so some of these steps may be in chunks).
            touched = np.concatenate([matrices[nid][0] for nid in redo]) // base
            lo, hi = int(touched.min()) * base, (int(touched.max()) + 1) * base - 1
            for nid, raw in self.points.read_many(conn, run_id, rank, redo, lo, hi, n_layers).items():
                contents[nid] = (raw.steps, raw.values)
        level_parts: Blocks = {}
        for nids in _alike({nid: (steps.tobytes(),) for nid, (steps, _) in contents.items()}):
            # The metrics of a batch share its steps: their blocks are reduced in one pass, side by side.
            keys, starts = group_starts(contents[nids[0]][0] // base)
            values = np.hstack([contents[nid][1] for nid in nids]) if len(nids) > 1 else contents[nids[0]][1]
            level_parts |= _split(nids, keys, Partials.from_values(values).reduce(starts), n_layers)
        self.upsert(conn, run_id, rank, base, level_parts)
        below = base
        for level in LEVELS[1:]:
            level_parts = self._parents(conn, run_id, rank, level, below, level_parts, n_layers, complete_before)
            if not level_parts:
                return
            self.upsert(conn, run_id, rank, level, level_parts)
            below = level

    def _parents(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        level: int,
        below: int,
        children: Blocks,
        n_layers: int,
        complete_before: int,
    ) -> Blocks:
        """The complete blocks of ``level`` (ending at or before ``complete_before``) above the ``children`` just
        computed (of level ``below``): each combined from its children, or from raw where one is not stored. Metrics
        whose blocks line up (the same parents wanted, the same children stored and computed: a batch's metrics share
        its steps) are combined side by side, in one pass."""
        factor = level // below
        wanted = {nid: np.unique(keys // factor) for nid, (keys, _) in children.items()}
        wanted = {nid: p[(p + 1) * level <= complete_before] for nid, p in wanted.items()}
        wanted = {nid: p for nid, p in wanted.items() if p.size}
        if not wanted:
            return {}
        lo_b = min(int(p[0]) for p in wanted.values()) * factor
        hi_b = (max(int(p[-1]) for p in wanted.values()) + 1) * factor - 1
        stored = self.read(conn, run_id, rank, list(wanted), below, lo_b, hi_b, n_layers)
        none = (np.zeros(0, dtype=np.int64), Partials.empty(0, n_layers))
        olds = {nid: stored.get(nid, none) for nid in wanted}
        out: Blocks = {}
        shapes = {nid: (p.tobytes(), olds[nid][0].tobytes(), children[nid][0].tobytes()) for nid, p in wanted.items()}
        for nids in _alike(shapes):
            out |= self._combine(conn, run_id, rank, nids, wanted[nids[0]], olds, children, factor, level, n_layers)
        return out

    def _combine(
        self,
        conn: Connection,
        run_id: int,
        rank: int,
        nids: list[int],
        parents: I64,
        olds: Blocks,
        children: Blocks,
        factor: int,
        level: int,
        n_layers: int,
    ) -> Blocks:
        """The ``parents`` of ``nids``, whose stored and computed children line up, combined side by side."""
        old_keys, old = olds[nids[0]][0], Partials.side_by_side([olds[nid][1] for nid in nids])
        new_keys, new = children[nids[0]][0], Partials.side_by_side([children[nid][1] for nid in nids])
        # This pass's children win over what is stored (the same blocks, or a partial one now complete).
        keep = np.flatnonzero(~np.isin(old_keys, new_keys))
        keys = np.concatenate([old_keys[keep], new_keys])
        order = np.argsort(keys, kind="stable")
        part = Partials.concat([old.take(keep), new]).take(order)
        keys = keys[order]
        mine = np.flatnonzero(np.isin(keys // factor, parents))
        found, starts = group_starts(keys[mine] // factor)
        width = n_layers * len(nids)
        combined = part.take(mine).reduce(starts) if found.size else Partials.empty(0, width)
        full = np.diff(np.append(starts, mine.size)) == factor
        short = parents[~np.isin(parents, found[full])]
        if not short.size:
            return _split(nids, found, combined, n_layers)
        # A child not stored (too few samples, or no steps at all): the parents short of children from raw.
        lo, hi = int(short[0]) * level, (int(short[-1]) + 1) * level - 1
        partials = self.step_partials(conn, run_id, rank, nids, lo, hi, n_layers)
        raws = [partials[nid] for nid in nids]
        kept = np.flatnonzero(full)

        def with_raw(steps: I64, values: Partials, done: Partials) -> tuple[I64, Partials]:
            take = np.flatnonzero(np.isin(steps // level, short))
            raw_keys, raw_starts = group_starts(steps[take] // level)
            parts = [done.take(kept)] + ([values.take(take).reduce(raw_starts)] if raw_keys.size else [])
            keys = np.concatenate([found[kept], raw_keys])
            order = np.argsort(keys, kind="stable")
            return keys[order], Partials.concat(parts).take(order)

        steps = raws[0][0]
        if all(np.array_equal(other, steps) for other, _ in raws[1:]):
            return _split(nids, *with_raw(steps, Partials.side_by_side([raw for _, raw in raws]), combined), n_layers)
        # Their raw steps differ (a metric not measured at every step): one metric at a time.
        return {
            nid: with_raw(raw_steps, raw, combined.columns(i * n_layers, (i + 1) * n_layers))
            for i, (nid, (raw_steps, raw)) in enumerate(zip(nids, raws, strict=True))
        }

    def upsert(self, conn: Connection, run_id: int, rank: int, level: int, parts: Blocks) -> None:
        """Write the blocks of ``parts`` that hold enough samples to be stored (see :data:`MIN_BLOCK_SAMPLES`)."""
        self._write(
            conn,
            run_id,
            rank,
            level,
            {nid: (keys, part, stored_blocks(keys, part)) for nid, (keys, part) in parts.items()},
        )

    def _write(
        self, conn: Connection, run_id: int, rank: int, level: int, parts: dict[int, tuple[I64, Partials, I64]]
    ) -> None:
        """Upsert the blocks ``which`` (indexes into ``keys``) of each name id's ``(keys, part, which)``."""
        rows = [
            {"run_id": run_id, "rank": rank, "name_id": nid, "level": level, "bucket": int(keys[i]), "stats": blob}
            for nid, (keys, part, which) in parts.items()
            if which.size  # most levels of sparse samples store no block (encoding none still cost ~30 µs)
            for i, blob in zip(which.tolist(), encode_blocks(part, which.tolist()), strict=True)
        ]
        if rows:
            conn.execute(self._upsert, rows)

    def step_partials(
        self, conn: Connection, run_id: int, rank: int, nids: Sequence[int], lo: int, hi: int, n_layers: int
    ) -> dict[int, tuple[I64, Partials]]:
        """Partials of each series ``nids`` of (run, rank) over [lo, hi]: one per raw point, and before the rank's
        retention cut, whose raw points are gone, one per base block (keyed by its first step; retention stores every
        base block of the steps it drops: :meth:`store_base_blocks`). The series are read together (a parent short of
        children is read for every metric of the rank)."""
        base = LEVELS[0]
        cut = max(lo, min(hi + 1, read_raw_from(conn, run_id, rank)))
        none = (np.zeros(0, dtype=np.int64), Partials.empty(0, n_layers))
        blocks = self.read(conn, run_id, rank, nids, base, lo // base, (cut - 1) // base, n_layers) if lo < cut else {}
        raws = self.points.read_many(conn, run_id, rank, nids, cut, hi, n_layers)
        out = {}
        for nid in nids:
            keys, part = blocks.get(nid, none)
            raw = raws[nid]
            out[nid] = (
                np.concatenate([keys * base, raw.steps]),
                Partials.concat([part, Partials.from_values(raw.values)]),
            )
        return out

    def store_base_blocks(
        self, conn: Connection, run_id: int, rank: int, nids: Sequence[int], lo: int, hi: int, n_layers: int
    ) -> None:
        """Store every base block of steps [lo, hi] of ``nids`` that holds a sample but is not stored (it had too few
        samples): retention is about to drop the raw points its steps would be read from."""
        base = LEVELS[0]
        stored = self.read(conn, run_id, rank, nids, base, lo // base, hi // base, n_layers)
        missing: dict[int, tuple[I64, Partials, I64]] = {}
        for nid, raw in self.points.read_many(conn, run_id, rank, nids, lo, hi, n_layers).items():
            if not raw.steps.size:
                continue
            keys, starts = group_starts(raw.steps // base)
            have = stored.get(nid, (np.zeros(0, dtype=np.int64), None))[0]
            missing[nid] = (keys, Partials.from_values(raw.values).reduce(starts), np.flatnonzero(~np.isin(keys, have)))
        self._write(conn, run_id, rank, base, missing)


def _alike(shapes: Mapping[int, tuple[bytes, ...]]) -> list[list[int]]:
    """Name ids grouped by equal shape (whatever the caller keys them by), in first-seen order."""
    groups: dict[tuple[bytes, ...], list[int]] = {}
    for nid, shape in shapes.items():
        groups.setdefault(shape, []).append(nid)
    return list(groups.values())


def _split(nids: list[int], keys: I64, part: Partials, n_layers: int) -> Blocks:
    """Blocks of ``nids`` whose partials lie side by side in ``part``, each ``n_layers`` wide."""
    return {nid: (keys, part.columns(i * n_layers, (i + 1) * n_layers)) for i, nid in enumerate(nids)}
