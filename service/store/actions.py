"""The run's actions (``run_actions``): written with the batch that carries them, listed for the API."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session, sessionmaker

from quantwatch.service.batch import IngestBatch
from quantwatch.service.models import RunAction
from quantwatch.service.store.common import find_run


def write_actions(conn: Connection, insert: Any, run_id: int, batch: IngestBatch, now: float) -> None:
    """Store the batch's actions (inside the ingest transaction); one already stored is kept as it was."""
    rows = [
        {
            "run_id": run_id,
            "rank": batch.rank,
            "step": a.step,
            "action": a.action,
            "layer": a.layer,
            "detail": a.detail,
            "episode_id": a.episode,
            "recorded_at": now,
        }
        for a in batch.actions
    ]
    if rows:
        conn.execute(insert(RunAction).on_conflict_do_nothing(), rows)


def list_actions(factory: sessionmaker[Session], run: str) -> list[dict[str, Any]]:
    """The actions of ``run`` by step, then rank (raises NotFoundError for an unknown run)."""
    with factory() as session:
        run_id = find_run(session, run).id
        rows = session.execute(
            select(RunAction)
            .where(RunAction.run_id == run_id)
            .order_by(RunAction.step, RunAction.rank, RunAction.action, RunAction.layer)
        ).scalars()
        return [
            {
                "step": r.step,
                "rank": r.rank,
                "action": r.action,
                "layer": r.layer,
                "detail": r.detail,
                "episode": r.episode_id,
                "recorded_at": r.recorded_at,
            }
            for r in rows
        ]
