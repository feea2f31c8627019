"""``/api/v1/rules``: alert rules as data (reads need ``read``, writes ``admin``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Body, Response

from quantwatch.service.alerts import queries
from quantwatch.service.alerts.catalog import ConflictError
from quantwatch.service.alerts.rules import Rule
from quantwatch.service.alerts.schemas import RuleOut
from quantwatch.service.api.deps import AdminAuth, AlertsDep, StoreDep
from quantwatch.service.api.named import NAME_TAKEN, answer_404, catalog_router, not_found, require_path_name
from quantwatch.service.api.problems import ProblemError

NOT_FOUND = not_found("rule")

LIST_DOC = "Every rule: shipped defaults, rules-file rules and API rules, enabled or not."
GET_DOC = "One rule by name."
router = catalog_router("rule", queries.RULES, RuleOut, every=LIST_DOC, one=GET_DOC)

RuleBody = Annotated[Rule, Body(description="The rule; invalid fields are refused with 422 naming them.")]


def _conflict(exc: ConflictError) -> ProblemError:
    if exc.field == "name":
        return ProblemError(409, str(exc))
    return ProblemError(422, f"body.{exc.field}: {exc}", errors=[{"field": f"body.{exc.field}", "message": str(exc)}])


@router.post("", response_model=RuleOut, status_code=201, dependencies=[AdminAuth], responses=NAME_TAKEN)
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
