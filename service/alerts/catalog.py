"""Rules and receivers in the database: the rules file synced at start-up, and the REST API's changes.

Precedence: a rule or receiver changed through the API (``source='api'``) wins over the rules file and the shipped
defaults, across restarts. Deleting a default or file rule through the API disables it (otherwise the next start
would bring it back). Changing or removing a rule ends its open episodes (resolved, with a notification) and clears
its series state, so a new definition starts from scratch.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

from quantwatch.service.alerts import repository
from quantwatch.service.alerts.engine import AlertEngine
from quantwatch.service.alerts.firing import ROUTES_RANK, redraw_firing_token
from quantwatch.service.alerts.rules import DEFAULT_RULES, ReceiverSpec, Rule, RulesFile
from quantwatch.service.alerts.tables import ReceiverRow, RuleRow

__all__ = [
    "ConflictError",
    "NotFoundError",
    "delete_receiver",
    "delete_rule",
    "put_receiver",
    "put_rule",
    "retire_rule_state",
    "sync_rules_file",
]


class NotFoundError(LookupError):
    """No rule or receiver of that name."""


class ConflictError(ValueError):
    """A rule or receiver of that name exists already, or a rule names a receiver that does not."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _definition(rule: Rule) -> dict[str, Any]:
    return rule.definition()


def _receiver_values(spec: ReceiverSpec) -> dict[str, Any]:
    return {
        "type": spec.type,
        "url": spec.url,
        "secrets": [secret.get_secret_value() for secret in spec.secrets],
        "headers": dict(spec.headers),
        "timeout_seconds": spec.timeout_seconds,
        "send_resolved": spec.send_resolved,
        "enabled": spec.enabled,
    }


def retire_rule_state(session: Session, engine: AlertEngine, row: RuleRow, reason: str) -> int:
    """End ``row``'s open episodes (firing ones resolve with a notification) and clear its series state."""
    now = time.time()
    rule = Rule.model_validate(row.definition)
    notified = 0
    resolved: set[str] = set()
    for episode in repository.open_episodes(session, row.id):
        if episode.state == "pending":
            session.delete(episode)
            continue
        resolved.add(episode.run)
        episode.state = "resolved"
        episode.resolved_at = now
        episode.resolved_step = episode.step
        session.flush()
        notified += engine.notify(session, episode, rule, "resolved")
        episode.annotations = {**episode.annotations, "resolved_reason": reason}
    repository.clear_rule_state(session, row.id)
    session.flush()
    for run in sorted(resolved):  # their runs' ingest answers list them no more
        redraw_firing_token(session, run, ROUTES_RANK)
    return notified


def _check_receivers_exist(session: Session, rule: Rule) -> None:
    if not rule.receivers:
        return
    known = repository.known_receivers(session, rule.receivers)
    for position, name in enumerate(rule.receivers):
        if name not in known:
            raise ConflictError(f"receivers.{position}", f"unknown receiver {name!r}")


def put_rule(session: Session, engine: AlertEngine, rule: Rule, *, create: bool) -> RuleRow:
    """Create (``create=True``; conflict if the name exists) or replace a rule through the API."""
    _check_receivers_exist(session, rule)
    row = repository.rule_by_name(session, rule.name)
    if create and row is not None:
        raise ConflictError("name", f"a rule named {rule.name!r} exists already")
    if not create and row is None:
        raise NotFoundError(rule.name)
    if row is None:
        row = RuleRow(name=rule.name, source="api", definition=_definition(rule), enabled=rule.enabled, revision=1)
        row.updated_at = time.time()
        session.add(row)
    else:
        retire_rule_state(session, engine, row, "rule replaced")
        row.source, row.definition, row.enabled = "api", _definition(rule), rule.enabled
        row.revision += 1
        row.updated_at = time.time()
    session.flush()
    return row


def delete_rule(session: Session, engine: AlertEngine, name: str) -> None:
    """Delete an API rule; disable a default or file rule (so a restart does not bring it back)."""
    row = repository.rule_by_name(session, name)
    if row is None:
        raise NotFoundError(name)
    retire_rule_state(session, engine, row, "rule deleted")
    if row.source == "api":
        session.delete(row)
    else:
        row.enabled = False
        row.source = "api"
        row.definition = {**row.definition, "enabled": False}
        row.revision += 1
        row.updated_at = time.time()
    session.flush()


def put_receiver(session: Session, spec: ReceiverSpec, *, create: bool, source: str = "api") -> ReceiverRow:
    """Create or replace a receiver; a replaced receiver that was disabled by a 410 is enabled again if asked."""
    row = repository.receiver_by_name(session, spec.name, for_update=True)
    if create and row is not None:
        raise ConflictError("name", f"a receiver named {spec.name!r} exists already")
    if not create and row is None:
        raise NotFoundError(spec.name)
    values = _receiver_values(spec)
    if row is None:
        row = ReceiverRow(name=spec.name, source=source, **values)
        session.add(row)
    else:
        for key, value in values.items():
            setattr(row, key, value)
        row.source = source
        row.disabled_reason = None
    row.updated_at = time.time()
    session.flush()
    return row


def delete_receiver(session: Session, name: str) -> None:
    """Delete a receiver; its pending deliveries go with it."""
    row = repository.receiver_by_name(session, name)
    if row is None:
        raise NotFoundError(name)
    session.delete(row)
    session.flush()


def sync_rules_file(session: Session, engine: AlertEngine, rules_file: RulesFile | None) -> None:
    """Make the database match the rules file (or the defaults alone), leaving API-managed entries alone.

    Run at start-up by every replica; row locks make concurrent runs agree.
    """
    desired: dict[str, tuple[str, Rule]] = {}
    if rules_file is None or rules_file.default_rules:
        desired.update({rule.name: ("default", rule) for rule in DEFAULT_RULES})
    if rules_file is not None:
        desired.update({rule.name: ("file", rule) for rule in rules_file.rules})
        for spec in rules_file.receivers:
            existing = repository.receiver_by_name(session, spec.name)
            if existing is None or existing.source == "file":
                put_receiver(session, spec, create=existing is None, source="file")
    wanted_receivers = {spec.name for spec in rules_file.receivers} if rules_file is not None else set()
    for receiver in repository.receivers_from(session, "file"):
        if receiver.name not in wanted_receivers:
            session.delete(receiver)
    rows = repository.rules_for_update(session)
    now = time.time()
    for name, (source, rule) in sorted(desired.items()):
        row = rows.get(name)
        if row is None:
            # Another replica starting at the same time may insert it first: keep whichever lands.
            repository.insert_ignore(
                session,
                RuleRow,
                [
                    {
                        "name": name,
                        "source": source,
                        "definition": _definition(rule),
                        "enabled": rule.enabled,
                        "revision": 1,
                        "updated_at": now,
                    }
                ],
                ("name",),
            )
        elif row.source != "api" and (row.definition != _definition(rule) or row.source != source):
            retire_rule_state(session, engine, row, "rules file changed")
            row.source, row.definition, row.enabled = source, _definition(rule), rule.enabled
            row.revision += 1
            row.updated_at = now
    for name, row in rows.items():
        if row.source != "api" and name not in desired:
            retire_rule_state(session, engine, row, "rule removed from the rules file")
            session.delete(row)
    session.flush()
