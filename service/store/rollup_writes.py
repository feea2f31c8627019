"""Rollup maintenance on the ingest path: every level's blocks brought up to date for a batch's steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, select

from quantwatch.service.models import Rollup
from quantwatch.service.rollups import F32, I64, LEVELS, Partials, group_starts
from quantwatch.service.store.raw_points import RawPoints


class RollupWriter:
    """Reads and upserts rollup blocks inside an ingest transaction (statements built once per store)."""

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
    ) -> dict[int, tuple[I64, Partials]]:
        """Stored blocks of ``level`` with bucket in [lo, hi] for each of ``nids``, by name id, bucket order."""
        rows = conn.execute(
            self._select,
            {"run_id": run_id, "rank": rank, "nids": list(nids), "level": level, "lo": lo, "hi": hi},
        ).all()
        out: dict[int, tuple[I64, Partials]] = {}
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][0] != rows[start][0]:
                chunk = rows[start:i]
                out[int(rows[start][0])] = (
                    np.array([r[1] for r in chunk], dtype=np.int64),
                    Partials.from_stats([r[2] for r in chunk], n_layers),
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
        *,
        merge: bool = True,
    ) -> None:
        """Bring every rollup level up to date for the given steps, all metrics at once per level.

        For a name id in ``replaced`` the touched base blocks are recomputed from the raw points (written first);
        for the others the values are merged into the stored blocks, or, with ``merge=False``, are taken as the
        whole content of their blocks (the compactor's case: it read them from raw).
        """
        base = LEVELS[0]
        level_parts: dict[int, tuple[I64, Partials]] = {}
        fresh = [nid for nid in matrices if nid not in replaced]
        stored_all: dict[int, tuple[I64, Partials]] = {}
        if fresh and merge:
            lo = min(int(matrices[nid][0][0]) for nid in fresh) // base
            hi = max(int(matrices[nid][0][-1]) for nid in fresh) // base
            stored_all = self.read(conn, run_id, rank, fresh, base, lo, hi, n_layers)
        for nid, (steps, values) in matrices.items():
            if nid in replaced:
                # Replaced values cannot be subtracted from a min or max: recompute the touched blocks from raw.
                touched = steps // base
                lo, hi = int(touched.min()) * base, (int(touched.max()) + 1) * base - 1
                # Behind the frontier, so some of these steps may be in chunks.
                raw = self.points.read(conn, {"run_id": run_id, "rank": rank, "nid": nid}, lo, hi, None, n_layers)
                keys, starts = group_starts(raw.steps // base)
                part = Partials.from_values(raw.values).reduce(starts)
            else:
                keys, starts = group_starts(steps // base)
                part = Partials.from_values(values).reduce(starts)
                old_keys, old = stored_all.get(nid, (np.zeros(0, dtype=np.int64), Partials.empty(0, n_layers)))
                if old_keys.size:
                    pos = np.searchsorted(keys, old_keys)
                    hit = (pos < keys.size) & (keys[np.minimum(pos, keys.size - 1)] == old_keys)
                    stored = Partials.empty(keys.size, n_layers)
                    stored.vmin[pos[hit]] = old.vmin[hit]
                    stored.vmax[pos[hit]] = old.vmax[hit]
                    stored.vsum[pos[hit]] = old.vsum[hit]
                    stored.vcount[pos[hit]] = old.vcount[hit]
                    part = part.merge(stored)
            level_parts[nid] = (keys, part)
        self.upsert(conn, run_id, rank, base, level_parts)
        below = base
        for level in LEVELS[1:]:
            factor = level // below
            lo_b = min(int(k[0]) for k, _ in level_parts.values()) // factor
            hi_b = max(int(k[-1]) for k, _ in level_parts.values()) // factor
            children = self.read(
                conn, run_id, rank, list(level_parts), below, lo_b * factor, (hi_b + 1) * factor - 1, n_layers
            )
            # Only the blocks above this batch's blocks change; recombine each from its (at most 4) children.
            wanted = {nid: np.unique(k // factor) for nid, (k, _) in level_parts.items()}
            next_parts: dict[int, tuple[I64, Partials]] = {}
            for nid, (child_keys, child) in children.items():
                keep = np.isin(child_keys // factor, wanted[nid])
                keys, starts = group_starts(child_keys[keep] // factor)
                next_parts[nid] = (keys, child.take(np.flatnonzero(keep)).reduce(starts))
            self.upsert(conn, run_id, rank, level, next_parts)
            level_parts = next_parts
            below = level

    def upsert(
        self, conn: Connection, run_id: int, rank: int, level: int, parts: dict[int, tuple[I64, Partials]]
    ) -> None:
        rows = []
        for nid, (keys, part) in parts.items():
            for i, bucket in enumerate(keys.tolist()):
                rows.append(
                    {
                        "run_id": run_id,
                        "rank": rank,
                        "name_id": nid,
                        "level": level,
                        "bucket": bucket,
                        "stats": part.stats(i),
                    }
                )
        if rows:
            conn.execute(self._upsert, rows)
