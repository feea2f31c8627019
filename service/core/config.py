"""Collector settings: argument > ``QUANTWATCH_…`` environment > default, frozen and validated on construction."""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Scope = Literal["ingest", "read", "admin"]
SCOPES: tuple[Scope, ...] = ("ingest", "read", "admin")
DEFAULT_DATABASE_URL = "sqlite:///./quantwatch.db"
DURATION_UNITS_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
"""The units of a duration setting such as ``retention_age`` (``90m``, ``12h``, ``30d``, ``2w``)."""


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine (127.0.0.0/8, ::1, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hash_token(token: str) -> str:
    """The SHA-256 hex digest under which a bearer token is kept in memory and compared."""
    return hashlib.sha256(token.encode()).hexdigest()


def _parse_scopes(field: str, raw: object) -> frozenset[Scope]:
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple | set | frozenset) or not items:
        raise ValueError(f"{field}: scopes must be a non-empty list drawn from {', '.join(SCOPES)}")
    scopes: set[Scope] = set()
    for item in items:
        name = str(item).strip()
        if name not in SCOPES:
            raise ValueError(f"{field}: unknown scope {name!r}; accepted: {', '.join(SCOPES)}")
        scopes.add(name)  # type: ignore[arg-type,unused-ignore]
    return frozenset(scopes)


def parse_duration_seconds(field: str, raw: object) -> object:
    """Seconds from a duration (``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"``) or a number of seconds; other
    values pass through for the field's own checks. Raises ValueError naming ``field`` for a malformed duration."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip().lower()
    number, unit = (text[:-1], text[-1]) if text[-1:] in DURATION_UNITS_SECONDS else (text, "s")
    try:
        value = float(number)
    except ValueError:
        units = ", ".join(DURATION_UNITS_SECONDS)
        raise ValueError(f"{field}: {raw!r} is not a duration: seconds, or a number with a unit ({units})") from None
    return value * DURATION_UNITS_SECONDS[unit]


def read_token_file(path: Path) -> dict[str, frozenset[Scope]]:
    """Read ``token scope[,scope…]`` lines (``#`` starts a comment) into token → scopes."""
    tokens: dict[str, frozenset[Scope]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2:
            raise ValueError(f"token_file: line {number} of {path} must be 'TOKEN SCOPE[,SCOPE…]'")
        tokens[parts[0]] = _parse_scopes(f"token_file line {number}", parts[1])
    return tokens


class Settings(BaseSettings):
    """Everything the collector is configured with. Environment variables carry the prefix ``QUANTWATCH_``.

    ``tokens`` maps a bearer token to its scopes (``ingest``, ``read``, ``admin``; ``admin`` implies the other two),
    e.g. ``QUANTWATCH_TOKENS='{"s3cret": ["ingest", "read"]}'``; ``token_file`` adds ``TOKEN SCOPES`` lines from a file.
    Without any token the collector only listens on loopback unless ``insecure`` is set.
    """

    model_config = SettingsConfigDict(env_prefix="QUANTWATCH_", frozen=True, extra="forbid")

    database_url: str = Field(
        default=DEFAULT_DATABASE_URL, description="SQLAlchemy URL: sqlite:///… or postgresql+psycopg://…"
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port to listen on (0 picks a free one).")
    tokens: dict[str, list[str]] = Field(default_factory=dict, description="Bearer token → scopes.")
    token_file: Path | None = Field(default=None, description="File of 'TOKEN SCOPE[,SCOPE…]' lines.")
    insecure: bool = Field(default=False, description="Allow listening beyond loopback without tokens.")
    rules_file: Path | None = Field(default=None, description="YAML file of alert rules.")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, le=1 << 31, description="Largest request body.")
    max_decoded_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024, le=1 << 33, description="Largest ingest body after gzip decoding."
    )
    max_pending_ingest: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Ingest requests held at once (reading, queued, storing); more get 429 with Retry-After.",
    )
    ingest_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Ingest requests decoded and stored at once, the others held on the event loop till one ends; "
        "unset: 4 on PostgreSQL (more threads only contend for the GIL), all of them on SQLite (its group commit "
        "queues the writers itself).",
    )
    ingest_read_timeout_seconds: float = Field(
        default=30.0, gt=0, le=3600, description="Longest wait for an ingest body to arrive; slower gets 408."
    )
    auto_upgrade: bool = Field(default=True, description="Run the Alembic migrations to head when the app is created.")
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        default="FULL", description="SQLite synchronous mode in WAL: FULL makes every acknowledged batch durable."
    )
    fold_chunks: bool = Field(
        default=True,
        description="Fold raw points behind the compaction frontier into compressed chunks, on a background thread "
        "(about half the bytes per point, slower reads of old steps; README Storage).",
    )
    retention_steps: int | None = Field(
        default=None,
        ge=1,
        le=2**62,
        description="Keep raw points for the newest N steps of each rank; older ones are dropped once their rollups "
        "are built (off by default: every raw point is kept; README Retention).",
    )
    retention_age: float | None = Field(
        default=None,
        gt=0,
        le=100 * 366 * 86400,
        description="Keep raw points this long by their step's time (seconds, or 90m, 12h, 30d, 2w); older ones are "
        "dropped once their rollups are built (off by default; README Retention).",
    )
    retention_interval_seconds: float = Field(
        default=300.0, gt=0, le=86400, description="How often the collector sweeps retention, when it is on."
    )
    db_pool_size: int = Field(default=8, ge=1, le=256, description="Connections kept open per collector process.")
    external_url: str | None = Field(
        default=None, description="Base URL of this collector in alert links (default http://host:port)."
    )
    alert_delivery_horizon_seconds: float = Field(
        default=86400.0, gt=0, le=30 * 86400, description="How long a notification is retried before it fails."
    )
    alert_retry_base_seconds: float = Field(
        default=1.0, gt=0, le=3600, description="First retry delay of a failed notification (doubles, jittered)."
    )
    alert_retry_max_seconds: float = Field(
        default=900.0, gt=0, le=86400, description="Longest delay between two attempts of a notification."
    )
    rank_compare_wait_seconds: float = Field(
        default=60.0, gt=0, le=86_400, description="How long a step waits for every rank of its replica group."
    )
    metrics_top_k: int = Field(
        default=64, ge=1, le=100_000, description="Layers exported to /metrics per (run, metric): the worst K."
    )
    metrics_run_ttl_seconds: float = Field(
        default=3600.0,
        gt=0,
        le=366 * 86400,
        description="Runs idle longer than this drop out of /metrics, and ranks idle that long their alert states out "
        "of memory.",
    )

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for token, scopes in value.items():
            if not token or any(ch.isspace() for ch in token):
                raise ValueError("tokens: a token must be non-empty and contain no whitespace")
            _parse_scopes(f"tokens[{token[:4]}…]", scopes)
        return value

    @field_validator("retention_age", mode="before")
    @classmethod
    def _parse_retention_age(cls, value: object) -> object:
        return parse_duration_seconds("retention_age", value)

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if not value.startswith(("sqlite://", "postgresql")):
            raise ValueError("database_url: must start with sqlite:// or postgresql+psycopg://")
        return value

    @model_validator(mode="after")
    def _check_exposure(self) -> Settings:
        if not self.insecure and not is_loopback(self.host) and not self.token_scopes():
            raise ValueError(
                f"host: refusing to listen on {self.host} without tokens; configure tokens or set insecure=True "
                "(--insecure)"
            )
        return self

    def token_scopes(self) -> dict[str, frozenset[Scope]]:
        """SHA-256 of each configured token → its scopes (``admin`` expanded to every scope)."""
        merged: dict[str, frozenset[Scope]] = {
            token: _parse_scopes("tokens", scopes) for token, scopes in self.tokens.items()
        }
        if self.token_file is not None:
            merged.update(read_token_file(self.token_file))
        return {
            hash_token(token): frozenset(SCOPES) if "admin" in scopes else scopes for token, scopes in merged.items()
        }
