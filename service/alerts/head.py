"""What a batch of one (run, rank) reads before the alert engine evaluates it, in one statement (issue 21).

Every batch checks four things that rarely change: the enabled rules' revisions (:class:`~quantwatch.service.alerts.
cache.RuleCache`), the tokens of the rank's series-state rows (the states this process wrote last are current while
they are unchanged), how many format changes the run has recorded (:class:`~quantwatch.service.alerts.formats.
LayerFormatRecorder`) and the run's firing tokens (:class:`~quantwatch.service.alerts.firing.FiringLists`). Four
statements were a fifth of a one-step batch's statements; one ``UNION ALL`` reads them all, after the rank's lock
(a token read before it could be overtaken by another replica's write), as driver SQL compiled once
(:class:`~quantwatch.service.core.driver_sql.DriverStatement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import BigInteger, Select, Table, and_, bindparam, func, literal_column, null, select, union_all
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Session

from quantwatch.service.alerts.tables import FiringTokenRow, LayerFormatRow, RuleRow, SeriesStatesRow
from quantwatch.service.core.driver_sql import DriverStatement

__all__ = ["BatchHead", "read_batch_head"]

_RULES = cast(Table, RuleRow.__table__)
_STATES = cast(Table, SeriesStatesRow.__table__)
_FIRING = cast(Table, FiringTokenRow.__table__)
_FORMATS = cast(Table, LayerFormatRow.__table__)
_RULE, _FIRING_TOKEN, _FORMAT_ROWS = 0, 1, 2  # the first column: which part a row answers
_NONE = sql_cast(null(), BigInteger)

_RULE_ROWS = (
    select(literal_column(str(_RULE)), _RULES.c.id, _RULES.c.revision, _STATES.c.token)
    .select_from(
        _RULES.outerjoin(
            _STATES,
            and_(
                _STATES.c.rule_id == _RULES.c.id,
                _STATES.c.run == bindparam("run"),
                _STATES.c.rank == bindparam("rank"),
            ),
        )
    )
    .where(_RULES.c.enabled.is_(True))
)
_FIRING_ROWS = select(literal_column(str(_FIRING_TOKEN)), _FIRING.c.rank, _FIRING.c.token, _NONE).where(
    _FIRING.c.run == bindparam("run")
)
_FORMAT_COUNT: Select[*tuple[Any, ...]] = (
    select(literal_column(str(_FORMAT_ROWS)), func.count(), _NONE, _NONE)
    .select_from(_FORMATS)
    .where(_FORMATS.c.run_id == bindparam("run_id"))
)
_WITH_FORMATS = DriverStatement(union_all(_RULE_ROWS, _FIRING_ROWS, _FORMAT_COUNT))
_WITHOUT_FORMATS = DriverStatement(union_all(_RULE_ROWS, _FIRING_ROWS))


@dataclass(frozen=True)
class BatchHead:
    """What :func:`read_batch_head` read for one (run, rank)."""

    rules: list[tuple[int, int]]
    """(id, revision) of every enabled rule, in id order."""
    series_tokens: dict[int, int]
    """The token of the (run, rank)'s stored row of each enabled rule that has one, by rule id."""
    firing_tokens: tuple[tuple[int, int], ...]
    """The run's firing tokens as (rank, token) in rank order (see :func:`~quantwatch.service.alerts.firing.
    firing_tokens`)."""
    format_rows: int | None
    """How many format changes the run has recorded (None: not read, no run id given)."""


def read_batch_head(session: Session, run: str, rank: int, run_id: int | None) -> BatchHead:
    """Read the :class:`BatchHead` of ``rank`` of ``run`` (stored as ``run_id``, when known) in one statement."""
    statement = _WITHOUT_FORMATS if run_id is None else _WITH_FORMATS
    params: dict[str, object] = {"run": run, "rank": rank}
    if run_id is not None:
        params["run_id"] = run_id
    rows = statement.execute(session.connection(), params).all()
    rules: list[tuple[int, int]] = []
    tokens: dict[int, int] = {}
    firing: list[tuple[int, int]] = []
    formats: int | None = None
    for part, key, value, token in rows:
        if part == _RULE:
            rules.append((int(key), int(value)))
            if token is not None:
                tokens[int(key)] = int(token)
        elif part == _FIRING_TOKEN:
            firing.append((int(key), int(value)))
        else:
            formats = int(key)
    return BatchHead(sorted(rules), tokens, tuple(sorted(firing)), formats)
