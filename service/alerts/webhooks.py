"""Notification bodies and Standard Webhooks signatures.

Webhook bodies are the Alertmanager webhook JSON (version "4") so receivers people already run accept them, plus a
``quantwatch`` block with the series details. Alertmanager receivers get the ``/api/v2/alerts`` body instead (a list of
postable alerts), so the user's Alertmanager routes, groups and silences them.

Signatures follow https://www.standardwebhooks.com: ``webhook-signature: v1,<base64 HMAC-SHA256 of
"{webhook-id}.{webhook-timestamp}.{body}">``, one ``v1,`` entry per secret (space separated) so secrets can be rotated.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote, urlencode

from quantwatch.service.alerts.rules import Rule, render_template
from quantwatch.service.rollups import json_float

__all__ = [
    "ALERTMANAGER_FIRING_TTL_SECONDS",
    "Notification",
    "alertmanager_body",
    "fingerprint",
    "rfc3339",
    "sign",
    "signature_headers",
    "webhook_body",
]

ALERTMANAGER_FIRING_TTL_SECONDS = 24 * 3600.0
"""``endsAt`` of a firing alert pushed to Alertmanager, counted from the push.

QuantWatch pushes an episode once when it fires and once when it resolves (with the real ``endsAt``); without an
``endsAt`` Alertmanager would resolve the alert by itself after its ``resolve_timeout`` (5 minutes by default), which
is shorter than many episodes.
"""

_ZERO_TIME = "0001-01-01T00:00:00Z"  # what Alertmanager's own webhooks send as endsAt of a firing alert


def rfc3339(epoch_seconds: float) -> str:
    """UTC RFC 3339 timestamp with milliseconds, ``Z`` suffix."""
    moment = datetime.fromtimestamp(epoch_seconds, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def fingerprint(labels: Mapping[str, str]) -> str:
    """A stable 16-hex-digit identity of a label set (the role of Alertmanager's fingerprint)."""
    digest = hashlib.sha256()
    for key in sorted(labels):
        digest.update(key.encode())
        digest.update(b"\xff")
        digest.update(labels[key].encode())
        digest.update(b"\xff")
    return digest.hexdigest()[:16]


def _format_value(value: float) -> str:
    return repr(float(value)) if math.isfinite(value) else str(json_float(value))


@dataclass(frozen=True)
class Notification:
    """One episode event to notify about (``firing`` or ``resolved``)."""

    status: Literal["firing", "resolved"]
    rule: Rule
    run: str
    layer: str
    ranks: Sequence[int]
    step: int
    value: float
    starts_at: float
    ends_at: float | None
    episode_id: int
    external_url: str
    remediation: str | None = None
    """What the layer's what-if statistics advise (``service/whatif/advice.py``); None without them."""

    def labels(self) -> dict[str, str]:
        """Alert labels: the rule's own plus ``alertname``, ``run``, ``layer``, ``metric``, ``severity``."""
        labels = dict(self.rule.labels)
        labels.update(alertname=self.rule.name, run=self.run, metric=self.rule.series, severity=self.rule.severity)
        if self.layer:
            labels["layer"] = self.layer
        return labels

    def annotations(self) -> dict[str, str]:
        """The rule's annotation templates rendered for this episode."""
        variables = {
            "rule": self.rule.name,
            "run": self.run,
            "layer": self.layer,
            "metric": self.rule.series,
            "op": self.rule.op,
            "threshold": self.rule.threshold,
            "value": _format_value(self.value),
            "step": self.step,
            "consecutive": self.rule.consecutive,
            "ranks": ",".join(str(rank) for rank in self.ranks),
            "severity": self.rule.severity,
        }
        annotations = {key: render_template(text, variables) for key, text in self.rule.annotations.items()}
        if self.remediation is not None:
            annotations["remediation"] = self.remediation
        return annotations

    def history_url(self) -> str:
        """Link to the history API for the watched series."""
        base = self.external_url.rstrip("/")
        run = quote(self.run, safe="")
        rank = min(self.ranks) if self.ranks else 0
        if self.rule.metric is not None:
            query = urlencode({"metric": self.rule.metric, "layer": self.layer, "rank": rank})
        else:
            # An expression links to the first scalar it names (the history API serves one series per request).
            query = urlencode({"scalar": sorted(self.rule.expression().names)[0], "rank": rank})
        return f"{base}/api/v1/runs/{run}/series?{query}"

    def alert(self) -> dict[str, Any]:
        """The alert object shared by both body shapes."""
        labels = self.labels()
        return {
            "status": self.status,
            "labels": labels,
            "annotations": self.annotations(),
            "startsAt": rfc3339(self.starts_at),
            "endsAt": rfc3339(self.ends_at) if self.ends_at is not None else _ZERO_TIME,
            "generatorURL": self.history_url(),
            "fingerprint": fingerprint(labels),
        }


def webhook_body(notification: Notification, receiver: str) -> dict[str, Any]:
    """The Alertmanager webhook (version 4) body for one receiver, plus the ``quantwatch`` block."""
    alert = notification.alert()
    labels = alert["labels"]
    group_labels = {"alertname": labels["alertname"], "run": labels["run"]}
    if "layer" in labels:
        group_labels["layer"] = labels["layer"]
    return {
        "version": "4",
        "groupKey": "{}:" + json.dumps(group_labels, sort_keys=True, separators=(",", ":")),
        "truncatedAlerts": 0,
        "status": notification.status,
        "receiver": receiver,
        "groupLabels": group_labels,
        "commonLabels": labels,
        "commonAnnotations": alert["annotations"],
        "externalURL": notification.external_url,
        "alerts": [alert],
        "quantwatch": {
            "episode_id": notification.episode_id,
            "rule": notification.rule.name,
            "run": notification.run,
            "layer": notification.layer or None,
            "metric": notification.rule.metric,
            "scalar": notification.rule.scalar,
            "ranks": list(notification.ranks),
            "step": notification.step,
            "value": json_float(float(notification.value)),
            "op": notification.rule.op,
            "threshold": notification.rule.threshold,
            "consecutive": notification.rule.consecutive,
            "history_url": notification.history_url(),
        },
    }


def alertmanager_body(notification: Notification, pushed_at: float) -> list[dict[str, Any]]:
    """The ``POST /api/v2/alerts`` body: one postable alert (labels, annotations, startsAt, endsAt, generatorURL)."""
    alert = notification.alert()
    ends_at = notification.ends_at if notification.ends_at is not None else pushed_at + ALERTMANAGER_FIRING_TTL_SECONDS
    return [
        {
            "labels": alert["labels"],
            "annotations": alert["annotations"],
            "startsAt": alert["startsAt"],
            "endsAt": rfc3339(ends_at),
            "generatorURL": alert["generatorURL"],
        }
    ]


def sign(keys: Sequence[bytes], webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,<base64>`` per key, space separated."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii") for key in keys
    )


def signature_headers(keys: Sequence[bytes], webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """``webhook-id``, ``webhook-timestamp`` and (with at least one key) ``webhook-signature``."""
    headers = {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp)}
    if keys:
        headers["webhook-signature"] = sign(keys, webhook_id, timestamp, body)
    return headers
