"""ASGI middleware timing the ingest route for :class:`IngestMetrics`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from quantwatch.service.exposition.ingest_metrics import IngestMetrics

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["IngestTimingMiddleware"]


class IngestTimingMiddleware:
    """ASGI middleware timing ``POST /api/v1/ingest`` and counting its outcome; every other request passes through.

    The ingest route marks a duplicate batch in the request state (``ingest_duplicate``).
    """

    def __init__(self, app: ASGIApp, metrics: IngestMetrics, path: str = "/api/v1/ingest") -> None:
        self.app = app
        self.metrics = metrics
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI request."""
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            duplicate = bool(scope.get("state", {}).get("ingest_duplicate", False))
            self.metrics.observe_request(status, time.perf_counter() - started, duplicate=duplicate)
