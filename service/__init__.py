"""The collector service: ingest, full-resolution history, alerts and Prometheus exposition.

The names below load on first use (PEP 562), so importing a light submodule (``quantwatch.service.core.config`` for
the command line's ``serve`` options, ``quantwatch.service.alerts.rules`` for ``rules check``) does not pull in
FastAPI, SQLAlchemy and numpy: ``quantwatch --help`` stays instant.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantwatch.service.app import create_app
    from quantwatch.service.batch import IngestBatch, IngestObserver, IngestStep
    from quantwatch.service.core.config import Settings
    from quantwatch.service.wire_error import WireError

__all__ = ["IngestBatch", "IngestObserver", "IngestStep", "Settings", "WireError", "create_app"]

_HOME = {
    "create_app": "quantwatch.service.app",
    "IngestBatch": "quantwatch.service.batch",
    "IngestObserver": "quantwatch.service.batch",
    "IngestStep": "quantwatch.service.batch",
    "WireError": "quantwatch.service.wire_error",
    "Settings": "quantwatch.service.core.config",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'quantwatch.service' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
