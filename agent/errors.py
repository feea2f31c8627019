"""The agent's exception tree.

``AgentError`` is the root.  ``ConfigError`` is raised by :func:`quantwatch.agent.attach` (and the value objects it
builds) for configuration mistakes, naming the offending field.  ``ExportError`` and its two children classify what
went wrong while sending a batch; they never reach the training loop: the exporter thread catches them, logs each kind
once and counts it.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "ConfigError",
    "CredentialExportError",
    "ExportError",
    "PermanentExportError",
    "TransientExportError",
]


class AgentError(Exception):
    """Base class of every error the agent defines."""


class ConfigError(AgentError, ValueError):
    """A configuration mistake, raised at ``attach()``; ``field`` names the offending argument."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ExportError(AgentError):
    """Sending a batch to the collector failed."""


class TransientExportError(ExportError):
    """A failure worth retrying: connection errors, timeouts, HTTP 429 and 5xx.

    ``retry_after_seconds`` carries the server's ``Retry-After`` hint when it sent one.
    """

    def __init__(self, message: str, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class PermanentExportError(ExportError):
    """A failure that retrying cannot fix: HTTP 4xx other than 401, 403, 408, 425 and 429 (bad payload, size)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class CredentialExportError(ExportError):
    """HTTP 401/403: the collector refuses the token, not the batch. The batch is kept (spooled) for a process with
    the right token (or ``quantwatch replay``), never dropped."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code
