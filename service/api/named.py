"""What the by-name catalog routes (``/api/v1/rules``, ``/api/v1/receivers``) share: the read routes, the 404 answer
and name checks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import GenericAlias
from typing import Any, TypeVar

from fastapi import APIRouter, Depends

from quantwatch.service.alerts.catalog import NotFoundError
from quantwatch.service.alerts.queries import NamedReads
from quantwatch.service.api.deps import ReadAuth, StoreDep, reject_nul
from quantwatch.service.api.problems import ProblemError

OutT = TypeVar("OutT")

NAME_TAKEN: dict[int | str, dict[str, Any]] = {409: {"description": "The name is taken"}}
"""The documented 409 answer of a create whose name is taken."""


@contextmanager
def answer_404(kind: str, name: str) -> Iterator[None]:
    """Turn the catalog's :class:`NotFoundError` inside the block into the 404 answer for an unknown ``kind``
    (``"rule"``, ``"receiver"``) called ``name``."""
    try:
        yield
    except NotFoundError:
        raise ProblemError(404, f"no {kind} named {name!r}") from None


def require_path_name(body_name: str, path_name: str) -> None:
    """Refuse (422 on ``body.name``) a PUT whose body names another object than its path."""
    if body_name != path_name:
        raise ProblemError(
            422,
            "body.name: must equal the name in the path",
            errors=[{"field": "body.name", "message": "must equal the name in the path"}],
        )


def not_found(kind: str) -> dict[int | str, dict[str, Any]]:
    """The documented 404 answer of the routes that name one ``kind``."""
    return {404: {"description": f"Unknown {kind}"}}


def catalog_router(kind: str, reads: NamedReads[Any, OutT], out: type[OutT], *, every: str, one: str) -> APIRouter:
    """The router of ``/api/v1/<kind>s`` (NUL bytes refused) with its read routes, which need ``read``: ``GET ""``
    lists every ``kind`` (described by ``every``), ``GET /{name}`` answers one or 404 (described by ``one``); named
    ``list_<kind>s`` and ``get_<kind>`` as their operation ids."""
    router = APIRouter(prefix=f"/api/v1/{kind}s", tags=["alerts"], dependencies=[Depends(reject_nul)])

    def list_all(store: StoreDep) -> list[OutT]:
        return reads.list(store.factory)

    def get_one(name: str, store: StoreDep) -> OutT:
        with answer_404(kind, name):
            return reads.get(store.factory, name)

    options: dict[str, Any] = {"methods": ["GET"], "dependencies": [ReadAuth]}
    every_model = GenericAlias(list, out)
    router.add_api_route("", list_all, response_model=every_model, name=f"list_{kind}s", description=every, **options)
    router.add_api_route(
        "/{name}",
        get_one,
        response_model=out,
        responses=not_found(kind),
        name=f"get_{kind}",
        description=one,
        **options,
    )
    return router
