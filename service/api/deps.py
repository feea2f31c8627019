"""Typed dependencies of the routes: every shared object the app factory keeps on ``app.state``, and bearer-token auth
by scope.

``app.state`` is an untyped bag; only this module reads it (one :class:`AppPart` per object, and the ``…Dep``
aliases built on them), so each object has one name and one type.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.api.gate import IngestGate
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.batch import IngestObserver
from quantwatch.service.core.config import Scope, Settings, hash_token
from quantwatch.service.core.db import WriteHealth
from quantwatch.service.ranks.checks import RankChecks
from quantwatch.service.store import Store

bearer = HTTPBearer(auto_error=False, description="A token configured with the scope the route names.")


FiringAlertCounts = Callable[[Sequence[str]], Mapping[str, int]]
T = TypeVar("T")


class AppPart(Generic[T]):
    """One object the app factory keeps on ``app.state``: its attribute name and its type, in one place."""

    def __init__(self, attribute: str) -> None:
        self.attribute = attribute

    def of(self, app: FastAPI) -> T:
        """The object on ``app``."""
        value: T = getattr(app.state, self.attribute)
        return value

    async def get(self, request: Request) -> T:
        """The route dependency. It does no I/O, so it is a coroutine: FastAPI runs a plain ``def`` dependency in the
        thread pool, and the two hops cost a series request ~0.5 ms of its p50 on a loaded machine (BENCHMARKS.md,
        issue 3)."""
        return self.of(request.app)


SETTINGS = AppPart[Settings]("settings")
"""The settings the app was built with."""
STORE = AppPart[Store]("store")
"""The app's data-access object."""
ALERTS = AppPart[AlertEngine]("alerts")
"""The app's alert engine (rules, evaluation on ingest, the outbox's sender)."""
INGEST_GATE = AppPart[IngestGate]("ingest_gate")
"""The app's ingest admission control."""
INGEST_OBSERVERS = AppPart[list[IngestObserver]]("ingest_observers")
"""The observers every stored batch goes through, in order (a list: the factory's parts append to it)."""
WRITE_HEALTH = AppPart[WriteHealth]("write_health")
"""Whether the database took the app's latest writes (what ``/readyz`` and the 503 answers report)."""
RANK_CHECKS = AppPart[RankChecks]("rank_checks")
"""The app's cross-rank checks (weight fingerprints, environments)."""
FIRING_ALERT_COUNTS = AppPart[FiringAlertCounts | None]("firing_alert_counts")
"""Run names → their firing alert count, for the run listings (None: no alerts part)."""
TOKEN_SCOPES = AppPart[dict[str, frozenset[str]]]("token_scopes")
"""Token digest → scopes; empty when no tokens are configured (then every request passes)."""

ingest_observers_of = INGEST_OBSERVERS.of


StoreDep = Annotated[Store, Depends(STORE.get)]
AlertsDep = Annotated[AlertEngine, Depends(ALERTS.get)]
WriteHealthDep = Annotated[WriteHealth, Depends(WRITE_HEALTH.get)]
RankChecksDep = Annotated[RankChecks, Depends(RANK_CHECKS.get)]
FiringAlertCountsDep = Annotated[FiringAlertCounts | None, Depends(FIRING_ALERT_COUNTS.get)]


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


def _authorize(request: Request, scope: Scope, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Raise the 401 or 403 problem unless ``credentials`` hold a token with ``scope`` (when tokens are configured)."""
    tokens = TOKEN_SCOPES.of(request.app)
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


async def check_scope(request: Request, scope: Scope) -> None:
    """What :func:`require`'s dependency checks, for a plain Starlette route (no dependency solving)."""
    if TOKEN_SCOPES.of(request.app):
        _authorize(request, scope, await bearer(request))


def require(scope: Scope) -> DependsParam:
    """A dependency that lets a request through only with a token holding ``scope`` (when tokens are configured)."""

    async def check(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        _authorize(request, scope, credentials)

    dependency: DependsParam = Depends(check)
    return dependency


IngestAuth = require("ingest")
ReadAuth = require("read")
AdminAuth = require("admin")
