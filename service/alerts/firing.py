"""A run's firing episodes as the ingest answer lists them, kept per process behind the run's firing tokens (issue 21).

Every ingest answer carries its run's firing episodes. With hundreds firing, reading the rows, building a dict per
episode and encoding them was up to a third of a one-step batch's CPU, although the list changes only when an
episode fires, resolves or fires on more ranks. Each transaction that changes the list redraws a token of the run
(:func:`redraw_firing_token`: the ingest of one rank, on any replica, its own row; the rule routes that end episodes
the run's row of rank -1), so :class:`FiringLists` reads the run's tokens — one index range in the batch's
transaction — and re-reads the list only when one moved. Tokens are random, not counters: a transaction that rolls
back after drawing one leaves a token that no committed state will ever carry again, so a list kept under it is never
mistaken for a current one. One row per rank: on PostgreSQL a row's lock is held to the commit, and the ranks of a
flapping run, which change the list in nearly every batch, would all queue on one row per run.

The tokens are read before the list, in the same transaction: a change committed in between (on PostgreSQL) is then
in the list but not in the tokens, and the next batch reads the list again; never the other way round.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, cast

import orjson
from sqlalchemy import Table, bindparam, select
from sqlalchemy.orm import Session

from quantwatch.protocol import FIRING_EPISODE_KEYS
from quantwatch.service.alerts.repository import draw_token
from quantwatch.service.alerts.tables import EpisodeRow, FiringTokenRow
from quantwatch.service.core.driver_sql import conflict_statements

__all__ = [
    "NO_FIRING",
    "ROUTES_RANK",
    "FiringList",
    "FiringLists",
    "firing_episodes",
    "firing_tokens",
    "redraw_firing_token",
]

MAX_RUNS = 1024
"""Runs whose list one process keeps (the least recently stored is forgotten first)."""

ROUTES_RANK = -1
"""The rank of the firing-token row the rule routes redraw (ranks of ingest are ≥ 0)."""

_TOKENS = cast(Table, FiringTokenRow.__table__)
_EPISODES = cast(Table, EpisodeRow.__table__)
_TOKENS_OF = select(_TOKENS.c.rank, _TOKENS.c.token).where(_TOKENS.c.run == bindparam("run")).order_by(_TOKENS.c.rank)


_TOKEN_UPSERTS = conflict_statements(_TOKENS, ("run", "rank"), ("token",))
_FIRING = (
    select(
        _EPISODES.c.id,
        _EPISODES.c.rule_name,
        _EPISODES.c.layer,
        _EPISODES.c.ranks,
        _EPISODES.c.firing_step,
        _EPISODES.c.severity,
    )
    .where(_EPISODES.c.run == bindparam("run"), _EPISODES.c.state == "firing")
    .order_by(_EPISODES.c.id)
)


def firing_tokens(session: Session, run: str) -> tuple[tuple[int, int], ...]:
    """The firing tokens of ``run`` as (rank, token) in rank order (empty while its list never changed since
    migration 0013)."""
    return tuple((int(rank), int(token)) for rank, token in session.connection().execute(_TOKENS_OF, {"run": run}))


def redraw_firing_token(session: Session, run: str, rank: int) -> None:
    """Draw a new firing token for ``rank`` of ``run`` (:data:`ROUTES_RANK` for the rule routes), in the caller's
    transaction that changes the run's firing episodes.

    On PostgreSQL the row's lock is held to the commit: the ingest path takes it after every other lock of its alert
    writes, and only the rank's own batches (already in turn on its cursor) want it.
    """
    conn = session.connection()
    conn.execute(_TOKEN_UPSERTS[conn.dialect.name], {"run": run, "rank": rank, "token": draw_token()})


def firing_episodes(session: Session, run: str) -> list[dict[str, Any]]:
    """The firing episodes of ``run`` as the ingest answer lists them (protocol ``FIRING_EPISODE_KEYS``, a key whose
    value is null left out), oldest first; one lookup of the (run, state) index, a statement built once."""
    rows = session.connection().execute(_FIRING, {"run": run})
    return [
        {
            key: value
            for key, value in zip(
                FIRING_EPISODE_KEYS, (episode, rule, layer, list(ranks), since, severity), strict=True
            )
            if value is not None
        }
        for episode, rule, layer, ranks, since, severity in rows
    ]


@dataclass(frozen=True)
class FiringList:
    """A run's firing episodes (see :func:`firing_episodes`) and their JSON encoding, shared: never mutate."""

    episodes: tuple[dict[str, Any], ...]
    json: orjson.Fragment


NO_FIRING = FiringList((), orjson.Fragment(b"[]"))


class FiringLists:
    """The firing list of each run this process answered for lately, by run: (tokens, list)."""

    def __init__(self) -> None:
        self._lists: dict[str, tuple[tuple[tuple[int, int], ...], FiringList]] = {}
        self._lock = threading.Lock()

    def current(self, session: Session, run: str, tokens: tuple[tuple[int, int], ...] | None = None) -> FiringList:
        """``run``'s firing list as ``session``'s transaction sees it: the one kept while its tokens are unchanged
        (``tokens``, read earlier in the transaction by :mod:`~quantwatch.service.alerts.head`; read now when None)."""
        token = firing_tokens(session, run) if tokens is None else tokens
        with self._lock:
            kept = self._lists.get(run)
        if kept is not None and kept[0] == token:
            return kept[1]
        episodes = firing_episodes(session, run)
        firing = FiringList(tuple(episodes), orjson.Fragment(orjson.dumps(episodes))) if episodes else NO_FIRING
        with self._lock:
            self._lists.pop(run, None)
            self._lists[run] = (token, firing)
            if len(self._lists) > MAX_RUNS:
                del self._lists[next(iter(self._lists))]
        return firing
