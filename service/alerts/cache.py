"""The rule cache: enabled rules parsed once per revision, shared by the threads of one collector process."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session

from quantwatch.service.alerts import repository
from quantwatch.service.alerts.rules import Rule

__all__ = ["RuleCache"]


class RuleCache:
    """Enabled rules as (id, Rule), re-read and re-parsed only when their revision changed (the revisions come with
    the batch's first statement, :mod:`~quantwatch.service.alerts.head`)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[int, Rule]] = {}
        self._lock = threading.Lock()

    def active_rules(self, session: Session, rows: Sequence[tuple[int, int]]) -> list[tuple[int, Rule]]:
        """The enabled rules in id order, as (id, Rule), given every enabled rule's (id, revision) ``rows``."""
        with self._lock:
            known = dict(self._by_id)
        # Only a rule whose revision changed is read whole and parsed again.
        stale = [rule_id for rule_id, revision in rows if known.get(rule_id, (None,))[0] != revision]
        definitions = repository.rule_definitions(session, stale) if stale else {}
        fresh: dict[int, tuple[int, Rule]] = {}
        for rule_id, revision in rows:
            cached = known.get(rule_id)
            if cached is not None and cached[0] == revision:
                fresh[rule_id] = cached
            elif rule_id in definitions:  # a rule deleted between the two statements is left out
                fresh[rule_id] = (revision, Rule.model_validate(definitions[rule_id]))
        with self._lock:
            self._by_id = fresh
        return [(rule_id, rule) for rule_id, (_, rule) in sorted(fresh.items())]
