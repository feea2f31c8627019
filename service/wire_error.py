"""The error of a batch a client sent that cannot be stored (the ingest decoders raise it; the route answers it as
problem+json)."""

from __future__ import annotations

__all__ = ["WireError"]


class WireError(ValueError):
    """A batch a client sent that cannot be stored: ``status`` 400 (undecodable) or 422 (schema), ``field`` names it."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.status = status
        self.field = field
        self.message = message
