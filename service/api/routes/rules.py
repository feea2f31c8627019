"""``/api/v1/rules``: alert rules as data (reads need ``read``, writes ``admin``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request, Response
from sqlalchemy import select

from quantwatch.service.alerts.catalog import ConflictError, NotFoundError, delete_rule, put_rule
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.schemas import RuleOut
from quantwatch.service.alerts.tables import RuleRow
from quantwatch.service.api.deps import AdminAuth, ReadAuth, StoreDep, reject_nul
from quantwatch.service.api.named import find_named, not_found, require_path_name
from quantwatch.service.api.problems import ProblemError
from quantwatch.service.core.db import write_session

NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "Unknown rule"}}
CONFLICT: dict[int | str, dict[str, Any]] = {409: {"description": "The name is taken"}}

router = APIRouter(prefix="/api/v1/rules", tags=["alerts"], dependencies=[Depends(reject_nul)])

RuleBody = Annotated[Rule, Body(description="The rule; invalid fields are refused with 422 naming them.")]


def _alerts(request: Request) -> AlertEngine:
    engine: AlertEngine = request.app.state.alerts
    return engine


def _conflict(exc: ConflictError) -> ProblemError:
    if exc.field == "name":
        return ProblemError(409, str(exc))
    return ProblemError(422, f"body.{exc.field}: {exc}", errors=[{"field": f"body.{exc.field}", "message": str(exc)}])


@router.get("", response_model=list[RuleOut], dependencies=[ReadAuth])
def list_rules(store: StoreDep) -> list[RuleOut]:
    """Every rule: shipped defaults, rules-file rules and API rules, enabled or not."""
    with store.factory() as session:
        return [RuleOut.of(row) for row in session.scalars(select(RuleRow).order_by(RuleRow.name))]


@router.get("/{name}", response_model=RuleOut, dependencies=[ReadAuth], responses=NOT_FOUND)
def get_rule(name: str, store: StoreDep) -> RuleOut:
    """One rule by name."""
    with store.factory() as session:
        return RuleOut.of(find_named(session, RuleRow, "rule", name))


@router.post("", response_model=RuleOut, status_code=201, dependencies=[AdminAuth], responses=CONFLICT)
def create_rule(rule: RuleBody, store: StoreDep, request: Request) -> RuleOut:
    """Add a rule (409 if the name is taken)."""
    try:
        with write_session(store.factory) as session:
            return RuleOut.of(put_rule(session, _alerts(request), rule, create=True))
    except ConflictError as exc:
        raise _conflict(exc) from None


@router.put("/{name}", response_model=RuleOut, dependencies=[AdminAuth], responses=NOT_FOUND)
def replace_rule(name: str, rule: RuleBody, store: StoreDep, request: Request) -> RuleOut:
    """Replace a rule; its open episodes resolve and its series start over under the new definition."""
    require_path_name(rule.name, name)
    try:
        with write_session(store.factory) as session:
            answer = RuleOut.of(put_rule(session, _alerts(request), rule, create=False))
    except ConflictError as exc:
        raise _conflict(exc) from None
    except NotFoundError:
        raise not_found("rule", name) from None
    _alerts(request).send_enqueued()
    return answer


@router.delete("/{name}", status_code=204, dependencies=[AdminAuth], responses=NOT_FOUND)
def remove_rule(name: str, store: StoreDep, request: Request) -> Response:
    """Delete an API rule, or disable a default or rules-file rule; firing episodes resolve."""
    try:
        with write_session(store.factory) as session:
            delete_rule(session, _alerts(request), name)
    except NotFoundError:
        raise not_found("rule", name) from None
    _alerts(request).send_enqueued()
    return Response(status_code=204)
