"""``/api/v1/receivers``: where notifications go (reads need ``read``, writes ``admin``; secrets are write-only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Body, Response

from quantwatch.service.alerts import queries
from quantwatch.service.alerts.catalog import ConflictError
from quantwatch.service.alerts.rules import ReceiverSpec
from quantwatch.service.alerts.schemas import ReceiverOut
from quantwatch.service.api.deps import AdminAuth, StoreDep
from quantwatch.service.api.named import NAME_TAKEN, answer_404, catalog_router, not_found, require_path_name
from quantwatch.service.api.problems import ProblemError

NOT_FOUND = not_found("receiver")

LIST_DOC = "Every receiver, without secrets or header values."
GET_DOC = "One receiver by name, without secrets or header values."
router = catalog_router("receiver", queries.RECEIVERS, ReceiverOut, every=LIST_DOC, one=GET_DOC)

ReceiverBody = Annotated[ReceiverSpec, Body(description="The receiver; `secret`/`secrets` and headers are write-only.")]


@router.post("", response_model=ReceiverOut, status_code=201, dependencies=[AdminAuth], responses=NAME_TAKEN)
def create_receiver(receiver: ReceiverBody, store: StoreDep) -> ReceiverOut:
    """Add a receiver (409 if the name is taken)."""
    try:
        return queries.save_receiver(store.factory, receiver, create=True)
    except ConflictError as exc:
        raise ProblemError(409, str(exc)) from None


@router.put("/{name}", response_model=ReceiverOut, dependencies=[AdminAuth], responses=NOT_FOUND)
def replace_receiver(name: str, receiver: ReceiverBody, store: StoreDep) -> ReceiverOut:
    """Replace a receiver (this also re-enables one disabled after a 410 when ``enabled`` is true)."""
    require_path_name(receiver.name, name)
    with answer_404("receiver", name):
        return queries.save_receiver(store.factory, receiver, create=False)


@router.delete("/{name}", status_code=204, dependencies=[AdminAuth], responses=NOT_FOUND)
def remove_receiver(name: str, store: StoreDep) -> Response:
    """Delete a receiver and its undelivered notifications."""
    with answer_404("receiver", name):
        queries.remove_receiver(store.factory, name)
    return Response(status_code=204)
