"""What the by-name catalog routes (``/api/v1/rules``, ``/api/v1/receivers``) share: lookup and name checks."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from quantwatch.service.alerts.tables import ReceiverRow, RuleRow
from quantwatch.service.api.problems import ProblemError

NamedRow = TypeVar("NamedRow", RuleRow, ReceiverRow)


def not_found(kind: str, name: str) -> ProblemError:
    """The 404 answer for an unknown ``kind`` (``"rule"``, ``"receiver"``) called ``name``."""
    return ProblemError(404, f"no {kind} named {name!r}")


def find_named(session: Session, table: type[NamedRow], kind: str, name: str) -> NamedRow:
    """The row of ``table`` called ``name``, or a 404 naming the ``kind`` of thing asked for."""
    row = session.scalars(select(table).where(table.name == name)).one_or_none()
    if row is None:
        raise not_found(kind, name)
    return row


def require_path_name(body_name: str, path_name: str) -> None:
    """Refuse (422 on ``body.name``) a PUT whose body names another object than its path."""
    if body_name != path_name:
        raise ProblemError(
            422,
            "body.name: must equal the name in the path",
            errors=[{"field": "body.name", "message": "must equal the name in the path"}],
        )
