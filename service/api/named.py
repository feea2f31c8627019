"""What the by-name catalog routes (``/api/v1/rules``, ``/api/v1/receivers``) share: the 404 answer and name checks."""

from __future__ import annotations

from quantwatch.service.api.problems import ProblemError


def not_found(kind: str, name: str) -> ProblemError:
    """The 404 answer for an unknown ``kind`` (``"rule"``, ``"receiver"``) called ``name``."""
    return ProblemError(404, f"no {kind} named {name!r}")


def require_path_name(body_name: str, path_name: str) -> None:
    """Refuse (422 on ``body.name``) a PUT whose body names another object than its path."""
    if body_name != path_name:
        raise ProblemError(
            422,
            "body.name: must equal the name in the path",
            errors=[{"field": "body.name", "message": "must equal the name in the path"}],
        )
