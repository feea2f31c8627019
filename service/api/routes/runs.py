"""Run history: list, detail, layers, series, heatmap, one step across ranks, export, delete."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from quantwatch.service.alerts.formats import layer_format_answers
from quantwatch.service.api.deps import (
    AdminAuth,
    FiringAlertCounts,
    FiringAlertCountsDep,
    ReadAuth,
    StoreDep,
    reject_nul,
)
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.rollups import dumps
from quantwatch.service.schemas import Heatmap, LayerInfo, RunActionInfo, RunSummary, Series, StepRanks


class NumpyJSONResponse(JSONResponse):
    """JSON rendered by orjson, numpy arrays included (float32 values as their shortest float32 text)."""

    def render(self, content: object) -> bytes:
        """Serialise ``content``."""
        return dumps(content)


router = APIRouter(prefix="/api/v1", tags=["runs"], dependencies=[Depends(reject_nul)])

NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "Unknown run, layer, metric or scalar"}}
MAX_STEP = 2**62
Rank = Annotated[int, Query(ge=0, le=2**31 - 1, description="Process rank.")]
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="First/last step of the range (inclusive).")]


def _with_alerts(counter: FiringAlertCounts | None, runs: list[dict[str, object]]) -> list[RunSummary]:
    counts = counter([str(r["name"]) for r in runs]) if counter is not None else {}
    return [RunSummary.model_validate({**r, "firing_alerts": counts.get(str(r["name"]), 0)}) for r in runs]


@router.get("/runs", response_model=list[RunSummary], dependencies=[ReadAuth])
def list_runs(store: StoreDep, firing: FiringAlertCountsDep) -> list[RunSummary]:
    """Every run with its step range, layer count, metrics and scalars seen, firing alerts and last-seen time."""
    return _with_alerts(firing, store.list_runs())


@router.get("/actions", response_model=list[RunActionInfo], dependencies=[ReadAuth], responses=NOT_FOUND)
def list_actions(run: Annotated[str, Query(description="The run.")], store: StoreDep) -> list[RunActionInfo]:
    """What the agent did to run ``run``'s training job (``quantwatch.agent.actions``: a layer kept in higher
    precision, a checkpoint saved, training stopped), by step. A query parameter, not a path below the run's: a run
    name may end in ``/actions``."""
    return [RunActionInfo.model_validate(action) for action in store.list_actions(run)]


@router.get("/runs/{run:path}/layers", response_model=list[LayerInfo], dependencies=[ReadAuth], responses=NOT_FOUND)
def list_layers(run: str, store: StoreDep) -> list[LayerInfo]:
    """Layers of a run in model order (the order the agent first sent them), each with its declared formats."""
    layers = store.list_layers(run)  # first: an unknown run is a 404
    formats = layer_format_answers(store.factory, run)
    unknown: dict[str, Any] = {"formats": None, "format_changes": []}
    return [LayerInfo.model_validate({**x, **formats.get(x["name"], unknown)}) for x in layers]


# Series and heatmaps are built as plain lists by the store and sent as they are: validating ~10⁵ floats through
# the response model would cost more than the query (the model still documents the shape).
@router.get("/runs/{run:path}/series", response_model=Series, dependencies=[ReadAuth], responses=NOT_FOUND)
def series(
    run: str,
    store: StoreDep,
    metric: Annotated[str | None, Query(max_length=200, description="Per-layer metric (needs layer).")] = None,
    layer: Annotated[str | None, Query(max_length=500)] = None,
    scalar: Annotated[str | None, Query(max_length=200, description="Per-run scalar, instead of metric.")] = None,
    rank: Rank = 0,
    start: Step = None,
    end: Step = None,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> NumpyJSONResponse:
    """min/mean/max over aligned power-of-two step buckets: exact (min = mean = max) when the range holds at most
    ``max_points`` samples; otherwise the smallest bucket width giving at most ``max_points`` buckets."""
    if (metric is None) == (scalar is None):
        raise ProblemError(
            422,
            "give exactly one of metric (with layer) or scalar",
            [{"field": "query.metric", "message": "metric or scalar"}],
        )
    if start is not None and end is not None and start > end:
        raise ProblemError(422, "start must not exceed end", [{"field": "query.start", "message": "start > end"}])
    if scalar is not None:
        return NumpyJSONResponse(store.scalar_series(run, scalar, rank, start, end, max_points))
    if metric is None or layer is None:
        raise ProblemError(
            422, "layer is required with metric", [{"field": "query.layer", "message": "required with metric"}]
        )
    return NumpyJSONResponse(store.series(run, metric, layer, rank, start, end, max_points))


@router.get("/runs/{run:path}/heatmap", response_model=Heatmap, dependencies=[ReadAuth], responses=NOT_FOUND)
def heatmap(
    run: str,
    store: StoreDep,
    metric: Annotated[str, Query(max_length=200)],
    rank: Rank = 0,
    start: Step = None,
    end: Step = None,
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 500,
    layers: Annotated[
        str | None, Query(max_length=500, description="Glob over layer names, e.g. blocks.*.mlp.*")
    ] = None,
    agg: Literal["max", "mean", "min"] = "max",
) -> NumpyJSONResponse:
    """Layers (model order) × aligned step buckets of one metric, each cell the bucket's ``agg``."""
    if start is not None and end is not None and start > end:
        raise ProblemError(422, "start must not exceed end", [{"field": "query.start", "message": "start > end"}])
    return NumpyJSONResponse(store.heatmap(run, metric, rank, start, end, max_steps, layers, agg))


@router.get("/runs/{run:path}/steps/{step}", response_model=StepRanks, dependencies=[ReadAuth], responses=NOT_FOUND)
def step_ranks(
    run: str,
    step: Annotated[int, Path(ge=0, le=MAX_STEP)],
    store: StoreDep,
    metric: Annotated[str, Query(max_length=200)],
) -> NumpyJSONResponse:
    """Layers (model order) × ranks of one metric at the first step at or after ``step`` that some rank measured it:
    compare the ranks of a data-parallel run layer by layer (a rank with no point there is null, not measured)."""
    return NumpyJSONResponse(store.step_ranks(run, metric, step))


@router.get(
    "/runs/{run:path}/export",
    dependencies=[ReadAuth],
    responses={
        **NOT_FOUND,
        200: {"content": {"text/csv": {}, "application/vnd.apache.parquet": {}}, "description": "Every point"},
    },
)
async def export(run: str, store: StoreDep, format: Literal["csv", "parquet"] = "csv") -> StreamingResponse:
    """Stream every stored point of the run with exact values (columns rank, step, time, kind, name, layer, value)."""
    if format == "parquet":
        try:
            import pyarrow  # noqa: F401  (optional dependency)
        except ImportError:
            raise ProblemError(406, "parquet export needs pyarrow: pip install 'quantwatch[parquet]'") from None
        body = await run_in_threadpool(store.export_parquet, run)
        media, suffix = "application/vnd.apache.parquet", "parquet"
    else:
        body = await run_in_threadpool(store.export_csv, run)
        media, suffix = "text/csv", "csv"
    filename = run.replace("/", "_") + "." + suffix
    return StreamingResponse(
        body, media_type=media, headers={"Content-Disposition": f'attachment; filename="{filename}"'}
    )


@router.delete("/runs/{run:path}", status_code=204, dependencies=[AdminAuth], responses=NOT_FOUND)
def delete_run(run: str, store: StoreDep) -> Response:
    """Delete a run and everything stored for it."""
    store.delete_run(run)
    return Response(status_code=204)


@router.get("/runs/{run:path}", response_model=RunSummary, dependencies=[ReadAuth], responses=NOT_FOUND)
def get_run(run: str, store: StoreDep, firing: FiringAlertCountsDep) -> RunSummary:
    """One run's summary."""
    return _with_alerts(firing, [store.get_run(run)])[0]
