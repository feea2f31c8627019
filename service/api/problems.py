"""RFC 9457 problem details: one place that turns every error into ``application/problem+json``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantwatch.service.core.db import WriteHealth, describe_database_error
from quantwatch.service.store import NotFoundError
from quantwatch.service.wire_error import WireError

PROBLEM_TYPE_BASE = "https://quantwatch.dev/problems/"
MEDIA_TYPE = "application/problem+json"
log = logging.getLogger("quantwatch.service")

TITLES = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    406: "not-acceptable",
    408: "request-timeout",
    409: "conflict",
    413: "payload-too-large",
    415: "unsupported-media-type",
    422: "validation-error",
    429: "too-many-requests",
    500: "internal-error",
    503: "unavailable",
}


class ProblemError(Exception):
    """An error answer: ``status``, a short ``detail``, optional ``errors`` and headers."""

    def __init__(
        self,
        status: int,
        detail: str,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = errors
        self.headers = headers


def problem_response(
    status: int, detail: str, errors: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """Build the problem+json response for ``status``."""
    slug = TITLES.get(status, "error")
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + slug,
        "title": slug.replace("-", " ").capitalize(),
        "status": status,
        "detail": detail,
    }
    if errors:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE, headers=headers)


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in loc)


PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details.",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}


def _document(app: FastAPI) -> None:
    """Make the OpenAPI schema say what the handlers do: every error is problem+json; API routes may 401/403/422."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()
        schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = PROBLEM_SCHEMA
        content = {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if path.startswith("/api/"):
                    responses.setdefault("401", {"description": "Missing or unknown bearer token"})
                    responses.setdefault("403", {"description": "Token lacks the scope this route needs"})
                    responses.setdefault("422", {"description": "Invalid parameters (errors name the field)"})
                for code, response in responses.items():
                    if code.isdigit() and int(code) >= 400:
                        response["content"] = content
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI, write_health: WriteHealth) -> None:
    """Register the handlers that make every error problem+json, and document them in the OpenAPI schema;
    database failures of writes are recorded in ``write_health``."""
    _document(app)

    async def on_problem(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProblemError)
        return problem_response(exc.status, exc.detail, exc.errors, exc.headers)

    async def on_wire(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, WireError)
        errors = [{"field": exc.field, "message": exc.message}] if exc.field else None
        return problem_response(exc.status, str(exc), errors)

    async def on_not_found(_request: Request, exc: Exception) -> JSONResponse:
        return problem_response(404, str(exc))

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [{"field": _loc(e.get("loc", ())), "message": str(e.get("msg", ""))} for e in exc.errors()]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or "invalid request"
        return problem_response(422, detail, errors)

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return problem_response(exc.status_code, str(exc.detail), headers=headers)

    async def on_database(request: Request, exc: Exception) -> JSONResponse:
        problem = describe_database_error(exc)
        if problem is None:
            return await on_unexpected(request, exc)
        if request.method not in ("GET", "HEAD"):
            write_health.failed(problem)  # logs the cause once, and /readyz answers 503 meanwhile
        else:
            log.warning("database unavailable: %s", problem.detail)
        # A disk that filled or a read-only file are not undone in a second; a busy or restarting database may be.
        retry_after = "5" if problem.cause in ("disk-full", "read-only") else "1"
        return problem_response(
            503, f"{problem.detail}; nothing of this request was stored, retry", headers={"Retry-After": retry_after}
        )

    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return problem_response(500, "internal error; the request may be retried")

    app.add_exception_handler(ProblemError, on_problem)
    app.add_exception_handler(WireError, on_wire)
    app.add_exception_handler(NotFoundError, on_not_found)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(DBAPIError, on_database)
    app.add_exception_handler(Exception, on_unexpected)
