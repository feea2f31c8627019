"""A small client for the collector's public REST API, used by the ``quantwatch`` command line.

Every failure is a :class:`CollectorError` whose ``exit_code`` is what the command line exits with, so scripts can
tell an unreachable collector from a missing run or a refused token (see :class:`ExitCode`).
"""

from __future__ import annotations

import enum
import json
import random
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any
from urllib.parse import quote, urlsplit

import httpx

from quantwatch.protocol import INGEST_PATH, Backoff, is_transient_status, parse_retry_after

__all__ = [
    "AuthError",
    "CollectorClient",
    "CollectorError",
    "ExitCode",
    "NotFoundError",
    "RejectedError",
    "ServerError",
    "UnreachableError",
    "validate_url",
]

DEFAULT_URL = "http://127.0.0.1:8000"
API_PREFIX = "/api/v1"
# Waits between ingest attempts: the protocol's one backoff rule, as the agent's exporter and the outbox use it.
MAX_RETRY_WAIT_SECONDS = 10.0
INGEST_BACKOFF = Backoff(initial_seconds=0.5, max_seconds=MAX_RETRY_WAIT_SECONDS)

Params = Mapping[str, str | int | float | None]


class ExitCode(enum.IntEnum):
    """Exit status of every ``quantwatch`` client command; documented in ``quantwatch --help``."""

    OK = 0
    SERVER_ERROR = 1  # the collector failed (5xx) or answered something that is not the API
    USAGE = 2  # bad arguments or an unreadable input file (click's own usage errors use 2 as well)
    UNREACHABLE = 3  # no connection to the collector (refused, DNS, timeout)
    NOT_FOUND = 4  # unknown run, layer, metric or route (404)
    AUTH = 5  # missing, wrong or under-scoped token (401/403)
    REJECTED = 6  # the collector refused the request as invalid (400/413/415/422)


class CollectorError(Exception):
    """A request to the collector failed; ``exit_code`` says how, ``str()`` says what to do about it."""

    exit_code: ExitCode = ExitCode.SERVER_ERROR

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        problem: Mapping[str, Any] | None = None,
        retry_after_seconds: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.problem: Mapping[str, Any] = problem or {}
        self.retry_after_seconds = retry_after_seconds


class UnreachableError(CollectorError):
    """No answer: connection refused, name not resolved, or timed out."""

    exit_code = ExitCode.UNREACHABLE


class NotFoundError(CollectorError):
    """404: the run, layer, metric or route does not exist."""

    exit_code = ExitCode.NOT_FOUND


class AuthError(CollectorError):
    """401/403: the token is missing, wrong, or lacks the scope."""

    exit_code = ExitCode.AUTH


class RejectedError(CollectorError):
    """400/413/415/422: the collector refused the request as invalid; the problem's detail says why."""

    exit_code = ExitCode.REJECTED


class ServerError(CollectorError):
    """5xx or an answer that is not the API's."""

    exit_code = ExitCode.SERVER_ERROR


def validate_url(url: str) -> str:
    """Return ``url`` without a trailing slash; raise ``ValueError`` naming ``--url`` unless it is http(s)://host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


def _problem_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _error_for(method: str, url: str, response: httpx.Response) -> CollectorError:
    problem = _problem_of(response)
    title = str(problem.get("title") or response.reason_phrase or "error")
    detail = problem.get("detail")
    status = response.status_code
    message = f"{status} {title}" + (f": {detail}" if detail else "") + f" ({method} {url})"
    errors = problem.get("errors")
    if isinstance(errors, list) and errors:
        message += "".join(f"\n  - {_describe_field_error(e)}" for e in errors[:10])
    kind: type[CollectorError]
    if status == 404:
        kind = NotFoundError
    elif status in (401, 403):
        kind = AuthError
        message += (
            "\n  Pass a token with --token or QUANTWATCH_TOKEN."
            if status == 401
            else "\n  The token lacks the scope this request needs."
        )
    elif 400 <= status < 500:
        kind = RejectedError
    else:
        kind = ServerError
    return kind(
        message,
        status=status,
        problem=problem,
        retry_after_seconds=parse_retry_after(response.headers.get("Retry-After")),
    )


def _describe_field_error(error: object) -> str:
    if isinstance(error, dict):
        where = error.get("field") or error.get("loc") or error.get("pointer")
        what = error.get("detail") or error.get("msg") or error.get("message")
        if isinstance(where, list):
            where = ".".join(str(p) for p in where)
        return f"{where}: {what}" if where else str(what)
    return str(error)


class CollectorClient:
    """Blocking client for one collector. ``transport`` is for tests that need a custom httpx transport."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout_seconds: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = validate_url(url)
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        headers = {"Accept": "application/json", "User-Agent": "quantwatch-cli"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_seconds, transport=transport)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> CollectorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def run_path(run: str, suffix: str = "") -> str:
        """The API path of ``run`` (names may hold ``/`` and ``:``, so they are percent-encoded)."""
        return f"{API_PREFIX}/runs/{quote(run, safe='')}{suffix}"

    @contextmanager
    def _transport_errors(self, method: str, url: str) -> Iterator[None]:
        try:
            yield
        except httpx.TimeoutException as exc:
            raise UnreachableError(
                f"the collector at {self.url} did not answer in time ({method} {url}): {exc}"
            ) from exc
        except httpx.TransportError as exc:
            raise UnreachableError(
                f"cannot reach the collector at {self.url} ({exc}).\n"
                "  Is `quantwatch serve` running there? Set --url or QUANTWATCH_URL."
            ) from exc

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = f"{self.url}{path}"
        with self._transport_errors(method, url):
            response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise _error_for(method, url, response)
        return response

    def get_json(self, path: str, params: Params | None = None) -> Any:
        """GET ``path`` (under the collector URL) and return its JSON body."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        response = self._send("GET", path, params=clean)
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(f"the collector answered GET {path} with something that is not JSON") from exc

    @contextmanager
    def stream(self, path: str, params: Params | None = None) -> Iterator[httpx.Response]:
        """GET ``path`` as a stream (for exports); the response is checked before it is yielded."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        url = f"{self.url}{path}"
        with self._transport_errors("GET", url), self._http.stream("GET", path, params=clean) as response:
            if response.status_code >= 400:
                response.read()
                raise _error_for("GET", url, response)
            yield response

    def download(self, path: str, params: Params, out: IO[bytes]) -> int:
        """Stream ``path`` into ``out``; return the number of bytes written."""
        written = 0
        with self.stream(path, params) as response:
            for chunk in response.iter_bytes():
                out.write(chunk)
                written += len(chunk)
        return written

    def ingest(
        self,
        body: bytes,
        *,
        attempts: int = 4,
        content_type: str = "application/json",
        gzipped: bool = False,
    ) -> dict[str, Any]:
        """POST one ingest batch as-is (JSON, or the agent's msgpack; ``gzipped`` bodies say so); wait and retry on
        transient answers (429, 5xx; honouring Retry-After)."""
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        headers = {"Content-Type": content_type}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        rng = random.Random()
        attempt = 1
        while True:
            try:
                response = self._send("POST", INGEST_PATH, content=body, headers=headers)
                break
            except CollectorError as exc:
                if exc.status is None or not is_transient_status(exc.status) or attempt >= attempts:
                    raise
                wait = INGEST_BACKOFF.wait_seconds(attempt, rng, exc.retry_after_seconds)
                time.sleep(min(wait, MAX_RETRY_WAIT_SECONDS))
                attempt += 1
        result = response.json()
        if not isinstance(result, dict):
            raise ServerError("the collector answered an ingest with something that is not a JSON object")
        return result


def dumps(value: object) -> str:
    """JSON for ``--json`` output: keys in the order the API sent them, UTF-8 as is."""
    return json.dumps(value, ensure_ascii=False, indent=2)
