"""``POST /api/v1/ingest``: batches from the agent, as JSON or msgpack, optionally gzip-encoded.

The POST is served by a plain Starlette route placed ahead of the FastAPI one (:func:`install`): FastAPI's routing and
dependency solving cost a one-step request ~0.18 ms of CPU of its ~9 (issue 21), for a route that reads its body raw
and answers bytes. The FastAPI route stays to document the request in the OpenAPI schema and to serve ``HEAD``; both
run :func:`ingest` after the same token check.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import anyio
import orjson
from fastapi import APIRouter, FastAPI, Request, Response
from starlette.routing import Route

from quantwatch.protocol import ingest_json_schema
from quantwatch.service.alerts.firing import FiringList
from quantwatch.service.api.deps import (
    ALERTS,
    INGEST_GATE,
    INGEST_OBSERVERS,
    SETTINGS,
    STORE,
    WRITE_HEALTH,
    IngestAuth,
    check_scope,
)
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.batch import IngestBatch, decode_json, decode_msgpack
from quantwatch.service.schemas import IngestAnswer
from quantwatch.service.store import IngestResult

router = APIRouter(prefix="/api/v1", tags=["ingest"])

BATCH_SCHEMA: dict[str, Any] = ingest_json_schema()
DECODERS = {
    "application/json": decode_json,
    "application/msgpack": decode_msgpack,
    "application/x-msgpack": decode_msgpack,
}


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProblemError(413, f"body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProblemError(413, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _gunzip(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(body, limit)
        if inflater.unconsumed_tail:
            raise ProblemError(413, f"gzip-decoded body exceeds the limit of {limit} bytes")
        out += inflater.flush()
    except zlib.error as exc:
        raise ProblemError(400, f"malformed gzip body: {exc}") from None
    if not inflater.eof:
        raise ProblemError(400, "malformed gzip body: truncated")
    return out


@router.head(
    "/ingest",
    status_code=204,
    dependencies=[IngestAuth],
    responses={204: {"description": "The token may ingest"}},
)
async def ingest_allowed() -> Response:
    """Whether the request's token may ingest: 204 when it may, 401/403 when not (the agent asks at ``attach()``,
    so a refused token is a configuration error there instead of a surprise at the first batch)."""
    return Response(status_code=204)


@router.post(
    "/ingest",
    response_model=IngestAnswer,
    response_model_exclude_none=True,
    dependencies=[IngestAuth],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": BATCH_SCHEMA},
                "application/msgpack": {"schema": BATCH_SCHEMA},
            },
        }
    },
    responses={
        400: {"description": "Malformed body"},
        408: {"description": "The body did not arrive within ingest_read_timeout_seconds; retry"},
        413: {"description": "Body too large"},
        415: {"description": "Unsupported content type or encoding"},
        422: {"description": "Schema violation (the problem's errors name the field)"},
        429: {"description": "Too many ingest requests in progress; retry after Retry-After"},
        503: {
            "description": "The database cannot store it now (disk full, read-only, locked, unreachable: the "
            "detail says which); nothing was stored; retry after Retry-After"
        },
    },
)
async def ingest(request: Request) -> Response:
    """Store a batch atomically; a repeated ``batch_id`` stores nothing and answers ``duplicate: true``.

    The answer lists the run's firing alert episodes (``firing_episodes``) when any fires, so the agent learns them
    without a request of its own (``monitor.on_alert``).

    Re-sent values for the same (run, rank, layer, metric, step) under a new batch id replace the old ones
    (last write wins).
    """
    # The app's parts read straight from the app, not as one dependency each: FastAPI's dependency solving for six
    # of them cost a one-step request more than its token check (the body is read raw, never validated by FastAPI).
    app = request.app
    settings, gate = SETTINGS.of(app), INGEST_GATE.of(app)
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    decoder = DECODERS.get(media)
    if decoder is None:
        raise ProblemError(415, "content type must be application/json or application/msgpack")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        raise ProblemError(415, "content encoding must be gzip or identity")
    if gate.pending >= gate.limit:
        raise ProblemError(
            429,
            f"{gate.pending} ingest requests are in progress, the limit is {gate.limit}; retry after Retry-After",
            headers={"Retry-After": str(gate.retry_after())},
        )
    gate.pending += 1
    started = time.perf_counter()
    try:
        try:
            async with asyncio.timeout(settings.ingest_read_timeout_seconds):
                body = await _read_body(request, settings.max_body_bytes)
        except TimeoutError:
            # A slow or stalled upload would hold its gate slot for as long as the client likes.
            raise ProblemError(
                408, f"the request body did not arrive within {settings.ingest_read_timeout_seconds:g} s; retry"
            ) from None

        store, alerts, observers = STORE.of(app), ALERTS.of(app), tuple(INGEST_OBSERVERS.of(app))

        def work() -> tuple[IngestResult, FiringList]:
            raw = _gunzip(body, settings.max_decoded_bytes) if encoding == "gzip" else body
            batch: IngestBatch = decoder(raw)
            stored = store.ingest(batch, observers)
            return stored, alerts.firing_of(batch)

        result, firing = await anyio.to_thread.run_sync(work, limiter=gate.limiter())
        WRITE_HEALTH.of(app).succeeded()
        gate.record(time.perf_counter() - started)
    finally:
        gate.pending -= 1
    request.state.ingest_duplicate = result.duplicate  # read by the exposition's ingest counters
    answer: dict[str, Any] = {"batch_id": result.batch_id, "duplicate": result.duplicate, "points": result.points}
    if firing.episodes:
        answer["firing_episodes"] = firing.json
    # IngestAnswer as response_model_exclude_none prints it, without building a FiringEpisode per firing episode and
    # validating it twice (with hundreds firing that was a sixth of a one-step request's CPU): the run's list comes
    # encoded, kept by the alert engine while it is unchanged.
    return Response(orjson.dumps(answer), media_type="application/json")


async def ingest_unrouted(request: Request) -> Response:
    """:func:`ingest` behind the token check of ``IngestAuth``, as a plain Starlette endpoint (see :func:`install`)."""
    await check_scope(request, "ingest")
    return await ingest(request)


def install(app: FastAPI) -> None:
    """Add the ingest routes to ``app``: the FastAPI router, and ahead of every route the plain POST route that serves
    what the FastAPI one documents (see the module's docstring)."""
    app.include_router(router)
    path = f"{router.prefix}/ingest"
    app.router.routes.insert(0, Route(path, ingest_unrouted, methods=["POST"], include_in_schema=False))
