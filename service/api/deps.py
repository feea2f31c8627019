"""Typed dependencies of the routes: every shared object the app factory keeps on ``app.state``, and bearer-token auth
by scope.

``app.state`` is an untyped bag; only this module reads it (``*_of(app)`` accessors, and the ``…Dep`` aliases built on
them), so each object has one name and one type.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

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


def settings_of(app: FastAPI) -> Settings:
    """The settings the app was built with."""
    settings: Settings = app.state.settings
    return settings


def store_of(app: FastAPI) -> Store:
    """The app's data-access object."""
    store: Store = app.state.store
    return store


def alerts_of(app: FastAPI) -> AlertEngine:
    """The app's alert engine (rules, evaluation on ingest, the outbox's sender)."""
    alerts: AlertEngine = app.state.alerts
    return alerts


def ingest_gate_of(app: FastAPI) -> IngestGate:
    """The app's ingest admission control."""
    gate: IngestGate = app.state.ingest_gate
    return gate


def ingest_observers_of(app: FastAPI) -> list[IngestObserver]:
    """The observers every stored batch goes through, in order (a list: the factory's parts append to it)."""
    observers: list[IngestObserver] = app.state.ingest_observers
    return observers


def write_health_of(app: FastAPI) -> WriteHealth:
    """Whether the database took the app's latest writes (what ``/readyz`` and the 503 answers report)."""
    health: WriteHealth = app.state.write_health
    return health


def rank_checks_of(app: FastAPI) -> RankChecks:
    """The app's cross-rank checks (weight fingerprints, environments)."""
    checks: RankChecks = app.state.rank_checks
    return checks


def firing_alert_counts_of(app: FastAPI) -> FiringAlertCounts | None:
    """Run names → their firing alert count, for the run listings (None: no alerts part)."""
    counts: FiringAlertCounts | None = app.state.firing_alert_counts
    return counts


def token_scopes_of(app: FastAPI) -> dict[str, frozenset[str]]:
    """Token digest → scopes; empty when no tokens are configured (then every request passes)."""
    tokens: dict[str, frozenset[str]] = app.state.token_scopes
    return tokens


# The dependencies below do no I/O, so they are coroutines: FastAPI runs a plain ``def`` dependency in the thread
# pool, and the two hops cost a series request ~0.5 ms of its p50 on a loaded machine (BENCHMARKS.md, issue 3).
async def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return settings_of(request.app)


async def get_store(request: Request) -> Store:
    """The app's data-access object."""
    return store_of(request.app)


async def get_alerts(request: Request) -> AlertEngine:
    """The app's alert engine."""
    return alerts_of(request.app)


async def get_ingest_gate(request: Request) -> IngestGate:
    """The app's ingest admission control."""
    return ingest_gate_of(request.app)


async def get_ingest_observers(request: Request) -> tuple[IngestObserver, ...]:
    """The ingest observers as they are now (a snapshot for one request)."""
    return tuple(ingest_observers_of(request.app))


async def get_write_health(request: Request) -> WriteHealth:
    """The app's record of database write failures."""
    return write_health_of(request.app)


async def get_rank_checks(request: Request) -> RankChecks:
    """The app's cross-rank checks."""
    return rank_checks_of(request.app)


async def get_firing_alert_counts(request: Request) -> FiringAlertCounts | None:
    """The firing alert counter of the run listings."""
    return firing_alert_counts_of(request.app)


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
AlertsDep = Annotated[AlertEngine, Depends(get_alerts)]
IngestGateDep = Annotated[IngestGate, Depends(get_ingest_gate)]
ObserversDep = Annotated[tuple[IngestObserver, ...], Depends(get_ingest_observers)]
WriteHealthDep = Annotated[WriteHealth, Depends(get_write_health)]
RankChecksDep = Annotated[RankChecks, Depends(get_rank_checks)]
FiringAlertCountsDep = Annotated[FiringAlertCounts | None, Depends(get_firing_alert_counts)]


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
        tokens = token_scopes_of(request.app)
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
