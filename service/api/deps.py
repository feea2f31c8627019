"""Typed dependencies of the routes: the store, and bearer-token auth by scope."""

from __future__ import annotations

import hmac
import json
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from quantwatch.service.api.problems import ProblemError
from quantwatch.service.core.config import Scope, hash_token
from quantwatch.service.store import Store

bearer = HTTPBearer(auto_error=False, description="A token configured with the scope the route names.")


# The dependencies below do no I/O, so they are coroutines: FastAPI runs a plain ``def`` dependency in the thread
# pool, and the two hops cost a series request ~0.5 ms of its p50 on a loaded machine (BENCHMARKS.md, issue 3).
async def get_store(request: Request) -> Store:
    """The app's data-access object."""
    store: Store = request.app.state.store
    return store


StoreDep = Annotated[Store, Depends(get_store)]


def _nul_field(value: Any, field: str) -> str | None:
    """The first field of a decoded JSON document whose key or string value holds a NUL character."""
    if isinstance(value, str):
        return field if "\x00" in value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{field}.{key}" if isinstance(key, str) else f"{field}[{key}]"
        if isinstance(key, str) and "\x00" in key:
            return where
        hit = _nul_field(item, where)
        if hit is not None:
            return hit
    return None


async def reject_nul(request: Request) -> None:
    """422 for a NUL character in the path, the query or a JSON body (no database stores it in text)."""
    if "\x00" in request.url.path:
        raise ProblemError(422, "the path contains a NUL character", [{"field": "path", "message": "NUL"}])
    for key, value in request.query_params.multi_items():
        if "\x00" in value or "\x00" in key:
            raise ProblemError(
                422, f"query.{key} contains a NUL character", [{"field": f"query.{key}", "message": "NUL"}]
            )
    body = await request.body()  # already read and cached by FastAPI for routes with a body
    if b"\\u0000" in body:
        try:
            field = _nul_field(json.loads(body), "body")
        except ValueError:
            return  # malformed JSON: the route's own validation answers it
        if field is not None:
            raise ProblemError(422, f"{field} contains a NUL character", [{"field": field, "message": "NUL"}])


def require(scope: Scope) -> DependsParam:
    """A dependency that lets a request through only with a token holding ``scope`` (when tokens are configured)."""

    async def check(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        tokens: dict[str, frozenset[str]] = request.app.state.token_scopes
        if not tokens:
            return
        challenge = {"WWW-Authenticate": "Bearer"}
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise ProblemError(401, "a bearer token is required", headers=challenge)
        digest = hash_token(credentials.credentials)
        scopes = next((s for h, s in tokens.items() if hmac.compare_digest(h, digest)), None)
        if scopes is None:
            raise ProblemError(401, "unknown token", headers=challenge)
        if scope not in scopes:
            raise ProblemError(403, f"this token lacks the {scope!r} scope")

    dependency: DependsParam = Depends(check)
    return dependency


IngestAuth = require("ingest")
ReadAuth = require("read")
AdminAuth = require("admin")
