"""``GET /api/v1/runs/{run}/whatif`` (the what-if statistics of a step) and ``GET /api/v1/runs/{run}/advice`` (the
cheapest formats within a budget, and the recipe spelling them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from quantwatch.protocol import MAX_LAYER_NAME_LENGTH, WHATIF_STATS, candidate_bits
from quantwatch.service.api.deps import ReadAuth, StoreDep, reject_nul
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.api.routes.runs import NOT_FOUND, Rank, Step
from quantwatch.service.rollups import json_float
from quantwatch.service.whatif.advice import (
    DEFAULT_BUDGET,
    DEFAULT_WINDOW,
    advise,
    parse_budget,
    recipe_python,
    recipe_yaml,
)

__all__ = ["router"]

router = APIRouter(prefix="/api/v1", tags=["runs"], dependencies=[Depends(reject_nul)])


def _entry(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {key: row[key] for key in ("layer", "kind", "candidate", "own")}
    out["bits"] = candidate_bits(row["candidate"])
    out.update({stat: None if row[stat] is None else json_float(row[stat]) for stat in WHATIF_STATS})
    return out


@router.get("/runs/{run:path}/whatif", dependencies=[ReadAuth], responses=NOT_FOUND)
def whatif(
    run: str,
    store: StoreDep,
    layer: Annotated[
        str | None, Query(max_length=MAX_LAYER_NAME_LENGTH, description="One layer (default: every layer).")
    ] = None,
    step: Step = None,
    rank: Rank = 0,
) -> dict[str, Any]:
    """The what-if statistics of ``step`` (default: the latest what-if step of ``layer``): per layer, tensor kind and
    candidate its ``bits``, ``rel_l2``, ``underflow_ratio``, ``overflow_ratio`` and whether it is the layer's
    ``own`` format; ``steps`` lists every what-if step stored. 404 for an unknown run or layer, or a step without
    what-if statistics; an empty answer (``step`` null) when the run has none (an agent that sends none)."""
    answer = store.whatif.at_step(run, rank, layer, step)
    answer["entries"] = [_entry(row) for row in answer["entries"]]
    return answer


@router.get("/runs/{run:path}/advice", dependencies=[ReadAuth], responses=NOT_FOUND)
def advice(
    run: str,
    store: StoreDep,
    rank: Rank = 0,
    budget: Annotated[
        str, Query(max_length=200, description="Bound on rel_l2: 0.05, or per kind weight=0.02,input=0.05,grad=0.1.")
    ] = str(DEFAULT_BUDGET),
    window: Annotated[int, Query(ge=1, le=10_000, description="The latest what-if steps to look at.")] = DEFAULT_WINDOW,
) -> dict[str, Any]:
    """Per layer and tensor kind the cheapest candidate (fewest bits, then lower error) whose worst ``rel_l2`` over
    the latest ``window`` what-if steps stays within ``budget`` (null: none does, keep that tensor in high
    precision), and the recipe: ``recipe.python`` builds a ``quantwatch.kernels.Recipe`` and torchao's
    ``module_filter_fn``, ``recipe.yaml`` says the same in YAML."""
    try:
        bounds = parse_budget(budget)
    except ValueError as exc:
        raise ProblemError(422, f"budget: {exc}", [{"field": "query.budget", "message": str(exc)}]) from None
    steps, rows = store.whatif.window(run, rank, window)
    layers = advise(rows, bounds)
    return {
        "run": run,
        "rank": rank,
        "budget": bounds,
        "window": window,
        "steps": steps,
        "layers": [
            {
                "layer": a.layer,
                "high_precision": a.high_precision,
                "kinds": {
                    kind: None if c is None else {"candidate": c.candidate, "bits": c.bits, "rel_l2": c.rel_l2}
                    for kind, c in a.kinds.items()
                },
            }
            for a in layers
        ],
        "high_precision": [a.layer for a in layers if a.high_precision],
        "recipe": {"python": recipe_python(layers, bounds, steps), "yaml": recipe_yaml(layers, bounds, steps)},
    }
