"""What the by-name catalog routes (``/api/v1/rules``, ``/api/v1/receivers``) share: the 404 answer and name checks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from quantwatch.service.alerts.catalog import NotFoundError
from quantwatch.service.api.problems import ProblemError


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
