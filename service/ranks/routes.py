"""``GET /api/v1/runs/{run}/ranks``: each rank's replica group and environment, the environment check, and the
cross-rank weight comparisons of the run."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from quantwatch.service.api.deps import RankChecksDep, ReadAuth, StoreDep, reject_nul
from quantwatch.service.ranks.checks import RankChecks
from quantwatch.service.ranks.tables import RankComparisonRow, RankEnvironmentRow
from quantwatch.service.rollups import json_float
from quantwatch.service.store import Store

__all__ = ["MAX_LISTED", "RanksAnswer", "router"]

MAX_LISTED = 100
"""Mismatching and incomplete steps listed at most (the first ones; the counts say how many there are)."""

router = APIRouter(prefix="/api/v1", tags=["runs"], dependencies=[Depends(reject_nul)])


class RankEntry(BaseModel):
    """One rank of the run."""

    rank: int
    group: str = Field(description="Its replica group ('0-7', or a hash for a group that is not a range).")
    environment: dict[str, str]
    reported_at: float
    differs: list[str] = Field(description="Environment fields in which this rank differs from the run's majority.")


class Mismatch(BaseModel):
    """A layer at a step where ranks of one replica group hold different weights."""

    step: int
    group: str
    layer: str
    reference_rank: int = Field(description="The majority's rank where there is a majority, else the lowest rank.")
    majority: bool
    ranks: list[int] = Field(description="The ranks that differ from the reference.")
    value: float | str = Field(description="The largest rank_weight_mismatch among them ('inf' when unbounded).")


class RanksAnswer(BaseModel):
    """The ranks of a run and what was checked across them."""

    run: str
    ranks: list[RankEntry]
    environment_consistent: bool = Field(description="False when ranks report different environments.")
    differing_fields: list[str] = Field(description="Environment fields whose values differ between ranks.")
    compared_steps: int
    incomplete_steps: int
    mismatched_steps: int
    mismatches: list[Mismatch] = Field(description=f"The first {MAX_LISTED} mismatching layers, by step.")
    incomplete: list[int] = Field(description=f"The first {MAX_LISTED} steps recorded as incomplete.")


def ranks_answer(store: Store, checks: RankChecks, run: str) -> RanksAnswer:
    """Settle what waited long enough, then read the run's ranks and comparisons (raises NotFoundError)."""
    store.run_id(run)
    checks.settle_run(run)
    with store.factory() as session:
        envs = session.scalars(
            select(RankEnvironmentRow).where(RankEnvironmentRow.run == run).order_by(RankEnvironmentRow.rank)
        ).all()
        counts = dict(
            session.execute(
                select(RankComparisonRow.status, func.count())
                .where(RankComparisonRow.run == run)
                .group_by(RankComparisonRow.status)
            ).all()
        )
        decided = session.scalars(
            select(RankComparisonRow).where(RankComparisonRow.run == run).order_by(RankComparisonRow.step)
        ).all()
    fields = sorted({key for env in envs for key in env.environment})
    differing = [f for f in fields if len({env.environment.get(f, "") for env in envs}) > 1]
    entries = []
    for env in envs:
        differs = []
        for field in differing:
            values = [other.environment.get(field, "") for other in envs]
            mine = env.environment.get(field, "")
            if values.count(mine) * 2 <= len(values):
                differs.append(field)
        entries.append(
            RankEntry(
                rank=env.rank,
                group=env.group_key,
                environment=env.environment,
                reported_at=env.reported_at,
                differs=differs,
            )
        )
    mismatches: list[dict[str, Any]] = []
    mismatched_steps = 0
    for row in decided:
        if row.mismatches:
            mismatched_steps += 1
        for m in row.mismatches:
            if len(mismatches) < MAX_LISTED:
                mismatches.append(
                    {**m, "step": row.step, "group": row.group_key, "value": json_float(float.fromhex(m["value"]))}
                )
    incomplete = [row.step for row in decided if row.status == "incomplete"][:MAX_LISTED]
    return RanksAnswer(
        run=run,
        ranks=entries,
        environment_consistent=not differing,
        differing_fields=differing,
        compared_steps=int(counts.get("compared", 0)),
        incomplete_steps=int(counts.get("incomplete", 0)),
        mismatched_steps=mismatched_steps,
        mismatches=[Mismatch.model_validate(m) for m in mismatches],
        incomplete=incomplete,
    )


@router.get(
    "/runs/{run:path}/ranks",
    response_model=RanksAnswer,
    dependencies=[ReadAuth],
    responses={404: {"description": "Unknown run"}},
)
async def list_ranks(run: str, store: StoreDep, checks: RankChecksDep) -> RanksAnswer:
    """Each rank's replica group and environment (``environment_consistent`` is false and ``differing_fields``
    names the fields when ranks differ; a rank's ``differs`` names those where it is in the minority) and the
    cross-rank weight comparisons: steps compared, steps recorded incomplete (some rank never reported: not a
    mismatch), and the layers whose replicas disagreed, with the ranks that differ from the reference."""
    return await run_in_threadpool(ranks_answer, store, checks, run)
