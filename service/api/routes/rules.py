"""``/api/v1/rules``: alert rules as data (reads need ``read``, writes ``admin``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Response

from quantwatch.service.alerts import queries
from quantwatch.service.alerts.catalog import ConflictError
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.schemas import RuleOut
from quantwatch.service.api.deps import AdminAuth, AlertsDep, ReadAuth, StoreDep, reject_nul
from quantwatch.service.api.named import answer_404, require_path_name
from quantwatch.service.api.problems import ProblemError

NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "Unknown rule"}}
CONFLICT: dict[int | str, dict[str, Any]] = {409: {"description": "The name is taken"}}

router = APIRouter(prefix="/api/v1/rules", tags=["alerts"], dependencies=[Depends(reject_nul)])

RuleBody = Annotated[Rule, Body(description="The rule; invalid fields are refused with 422 naming them.")]


def _conflict(exc: ConflictError) -> ProblemError:
    if exc.field == "name":
        return ProblemError(409, str(exc))
    return ProblemError(422, f"body.{exc.field}: {exc}", errors=[{"field": f"body.{exc.field}", "message": str(exc)}])


@router.get("", response_model=list[RuleOut], dependencies=[ReadAuth])
def list_rules(store: StoreDep) -> list[RuleOut]:
    """Every rule: shipped defaults, rules-file rules and API rules, enabled or not."""
    return queries.RULES.list(store.factory)


@router.get("/{name}", response_model=RuleOut, dependencies=[ReadAuth], responses=NOT_FOUND)
def get_rule(name: str, store: StoreDep) -> RuleOut:
    """One rule by name."""
    with answer_404("rule", name):
        return queries.RULES.get(store.factory, name)


@router.post("", response_model=RuleOut, status_code=201, dependencies=[AdminAuth], responses=CONFLICT)
def create_rule(rule: RuleBody, store: StoreDep, alerts: AlertsDep) -> RuleOut:
    """Add a rule (409 if the name is taken)."""
    try:
        return queries.save_rule(store.factory, alerts, rule, create=True)
    except ConflictError as exc:
        raise _conflict(exc) from None


@router.put("/{name}", response_model=RuleOut, dependencies=[AdminAuth], responses=NOT_FOUND)
def replace_rule(name: str, rule: RuleBody, store: StoreDep, alerts: AlertsDep) -> RuleOut:
    """Replace a rule; its open episodes resolve and its series start over under the new definition."""
    require_path_name(rule.name, name)
    with answer_404("rule", name):
        try:
            answer = queries.save_rule(store.factory, alerts, rule, create=False)
        except ConflictError as exc:
            raise _conflict(exc) from None
    alerts.send_enqueued()
    return answer


@router.delete("/{name}", status_code=204, dependencies=[AdminAuth], responses=NOT_FOUND)
def remove_rule(name: str, store: StoreDep, alerts: AlertsDep) -> Response:
    """Delete an API rule, or disable a default or rules-file rule; firing episodes resolve."""
    with answer_404("rule", name):
        queries.remove_rule(store.factory, alerts, name)
    alerts.send_enqueued()
    return Response(status_code=204)
