"""The demo's webhook receiver: a loopback HTTP server that checks each alert's Standard Webhooks signature."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Standard Webhooks: refuse timestamps further than this from now (replay protection).
WEBHOOK_TOLERANCE_SECONDS = 300
# The metrics whose worst layers the summary lists.


def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float | None = None,
    tolerance_seconds: float = WEBHOOK_TOLERANCE_SECONDS,
) -> bool:
    """Check a Standard Webhooks signature: HMAC-SHA256 over ``id.timestamp.body`` with the ``whsec_`` secret.

    True when any ``v1,`` signature in ``webhook-signature`` matches (compared in constant time) and the timestamp is
    within ``tolerance_seconds`` of ``now``. Header names are matched case-insensitively.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    webhook_id = lower.get("webhook-id")
    timestamp = lower.get("webhook-timestamp")
    signatures = lower.get("webhook-signature")
    if not webhook_id or not timestamp or not signatures or not secret.startswith("whsec_"):
        return False
    try:
        sent_at = int(timestamp)
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent_at) > tolerance_seconds:
        return False
    expected = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    for candidate in signatures.split():
        version, _, encoded = candidate.partition(",")
        if version != "v1":
            continue
        try:
            given = base64.b64decode(encoded, validate=True)
        except ValueError:
            continue
        if hmac.compare_digest(given, expected):
            return True
    return False


@dataclass(frozen=True)
class Notification:
    """One webhook the receiver got: its headers and raw body, whether the signature held, the decoded body."""

    webhook_id: str
    signature_valid: bool
    body: dict[str, Any]
    raw_body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """``firing`` or ``resolved``."""
        return str(self.body.get("status"))

    @property
    def details(self) -> dict[str, Any]:
        """The body's ``quantwatch`` block: rule, run, layer, metric, step, value, threshold."""
        block = self.body.get("quantwatch")
        return block if isinstance(block, dict) else {}


class WebhookReceiver:
    """An HTTP receiver on loopback that verifies each webhook's signature, keeps it and reports it."""

    def __init__(self, on_notification: Callable[[Notification], None] | None = None) -> None:
        self.secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode("ascii")
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        self._on_notification = on_notification
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                valid = verify_webhook(receiver.secret, dict(self.headers.items()), body)
                try:
                    decoded = json.loads(body)
                except ValueError:
                    decoded = {}
                notification = Notification(
                    webhook_id=self.headers.get("webhook-id") or "",
                    signature_valid=valid,
                    body=decoded if isinstance(decoded, dict) else {},
                    raw_body=body,
                    headers=dict(self.headers.items()),
                )
                receiver._record(notification)
                self.send_response(204 if valid else 401)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the demo prints each notification itself."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/webhook"
        self._thread = threading.Thread(target=self._server.serve_forever, name="demo-webhooks", daemon=True)

    def _record(self, notification: Notification) -> None:
        with self._lock:
            self.notifications.append(notification)
        if self._on_notification is not None:
            self._on_notification(notification)

    def start(self) -> None:
        """Start answering on :attr:`url`."""
        self._thread.start()

    def stop(self) -> None:
        """Stop and release the port."""
        self._server.shutdown()
        self._server.server_close()
