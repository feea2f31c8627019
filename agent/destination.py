"""Where a monitor's figures go: the exporter built from ``attach()``'s ``url`` / ``exporter`` / spool options."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from quantwatch.agent.errors import ConfigError
from quantwatch.agent.exporters import Exporter, HttpExporter, JsonLinesExporter, RetryPolicy
from quantwatch.agent.failures import FailureLog
from quantwatch.agent.spool import DiskSpool
from quantwatch.agent.wire import Encoding

__all__ = ["DEFAULT_URL", "make_exporter", "spool_directory"]

DEFAULT_URL = "http://127.0.0.1:8000"


def spool_directory(spool_dir: str | os.PathLike[str] | None, run: str, rank: int) -> Path:
    """Where ``run``'s batches for ``rank`` are spooled (``spool_dir``, env ``QUANTWATCH_SPOOL_DIR`` or the cache)."""
    base = spool_dir or os.environ.get("QUANTWATCH_SPOOL_DIR") or Path.home() / ".cache" / "quantwatch" / "spool"
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", run)[:80]
    digest = hashlib.sha256(run.encode()).hexdigest()[:12]
    return Path(base) / f"{readable}-{digest}" / f"rank-{rank}"


def make_exporter(
    url: str | None,
    exporter: Exporter | None,
    *,
    token: str | None,
    encoding: Encoding,
    compress: bool,
    spool_dir: str | os.PathLike[str] | None,
    spool_max_bytes: int,
    run: str,
    rank: int,
    failures: FailureLog,
    retry: RetryPolicy | None,
    timeout_seconds: float,
) -> Exporter:
    """The exporter ``attach()``'s options describe: ``exporter`` itself, a JSON-lines file for a ``file://`` URL,
    else HTTP to ``url`` (env ``QUANTWATCH_URL``, default loopback) with a disk spool.  Raises ConfigError."""
    if exporter is not None:
        if url is not None:
            raise ConfigError("exporter", "give either url= or exporter=, not both")
        if not isinstance(exporter, Exporter):
            raise ConfigError("exporter", "must implement export(batch), idle(), shutdown(), close(), counters()")
        return exporter
    url = url or os.environ.get("QUANTWATCH_URL") or DEFAULT_URL
    if not isinstance(url, str):
        raise ConfigError("url", f"must be a string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme == "file":
        if not parts.path:
            raise ConfigError("url", f"a file URL needs a path, got {url!r}")
        return JsonLinesExporter(parts.path, failures=failures)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise ConfigError("url", f"must be http(s)://host[:port][/prefix] or file:///path.jsonl, got {url!r}")
    if encoding not in ("msgpack", "json"):
        raise ConfigError("encoding", f"must be 'msgpack' or 'json', got {encoding!r}")
    if not isinstance(spool_max_bytes, int) or spool_max_bytes < 0:
        raise ConfigError("spool_max_bytes", f"must be an integer >= 0 (0 disables the spool), got {spool_max_bytes!r}")
    spool = None
    if spool_max_bytes > 0:
        directory = spool_directory(spool_dir, run, rank)
        try:
            spool = DiskSpool(directory, spool_max_bytes)
        except OSError as exc:
            raise ConfigError("spool_dir", f"cannot use {directory}: {exc}") from exc
    source = "token" if token else "QUANTWATCH_TOKEN"
    token = token or os.environ.get("QUANTWATCH_TOKEN") or None
    http = HttpExporter(
        url,
        token=token,
        encoding=encoding,
        compress=compress,
        spool=spool,
        failures=failures,
        retry=retry,
        timeout_seconds=timeout_seconds,
    )
    try:
        http.check_token(source, timeout_seconds=min(2.0, timeout_seconds))
    except ConfigError:
        http.close()
        raise
    return http
