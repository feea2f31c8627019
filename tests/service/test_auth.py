"""Auth: every route of the OpenAPI schema refuses missing/wrong tokens (401) and wrong scopes (403)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from quantwatch.service import Settings

TOKENS = {"tok-ingest": ["ingest"], "tok-read": ["read"], "tok-admin": ["admin"]}
# Probes stay open so orchestrators can call them; everything else needs a token.
PUBLIC = {("GET", "/healthz"), ("GET", "/readyz")}


def _scope(method: str, path: str) -> str:
    if path.endswith("/ingest"):  # POST stores a batch, HEAD asks whether the token may
        return "ingest"
    return "read" if method == "GET" else "admin"


def test_every_route_checks_tokens_and_scopes(start_collector: Callable[..., Any]) -> None:
    server = start_collector(tokens=TOKENS)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        schema = http.get("/openapi.json").json()
        walked = 0
        for path, ops in schema["paths"].items():
            url = re.sub(r"\{[^}]+\}", "some-run", path)
            for method in ops:
                method = method.upper()
                if (method, path) in PUBLIC:
                    assert http.request(method, url).status_code == 200
                    continue
                scope = _scope(method, path)
                walked += 1
                missing = http.request(method, url)
                assert missing.status_code == 401, (method, path)
                assert missing.headers["content-type"] == "application/problem+json"
                assert missing.headers["www-authenticate"] == "Bearer"
                wrong = http.request(method, url, headers={"Authorization": "Bearer not-a-token"})
                assert wrong.status_code == 401, (method, path)
                other = "tok-read" if scope != "read" else "tok-ingest"
                assert http.request(method, url, headers={"Authorization": f"Bearer {other}"}).status_code == 403, (
                    method,
                    path,
                )
                right = http.request(method, url, headers={"Authorization": f"Bearer tok-{scope}"})
                assert right.status_code not in (401, 403), (method, path)
                admin = http.request(method, url, headers={"Authorization": "Bearer tok-admin"})
                assert admin.status_code not in (401, 403), (method, path)
        assert walked >= 7


def test_token_file(make_app: Callable[..., Any], tmp_path: Any) -> None:
    from fastapi.testclient import TestClient

    path = tmp_path / "tokens"
    path.write_text("# reader\nfile-read read\nfile-both ingest,read\n")
    with TestClient(make_app(token_file=path)) as client:
        assert client.get("/api/v1/runs", headers={"Authorization": "Bearer file-read"}).status_code == 200
        assert client.get("/api/v1/runs").status_code == 401
        assert client.delete("/api/v1/runs/x", headers={"Authorization": "Bearer file-both"}).status_code == 403


def test_listening_beyond_loopback_needs_tokens_or_insecure() -> None:
    with pytest.raises(ValidationError, match=r"host: refusing to listen on 0\.0\.0\.0"):
        Settings(host="0.0.0.0")
    assert Settings(host="0.0.0.0", insecure=True).insecure
    assert Settings(host="0.0.0.0", tokens={"t": ["read"]}).token_scopes()
    assert Settings(host="::1").host == "::1"
    with pytest.raises(ValidationError, match="unknown scope 'write'"):
        Settings(tokens={"t": ["write"]})


def test_serve_refuses_to_bind_everywhere_without_tokens(tmp_path: Any) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "quantwatch.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--database-url",
            f"sqlite:///{tmp_path / 'x.db'}",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 2
    assert "refusing to listen on 0.0.0.0" in out.stderr
    assert not (tmp_path / "x.db").exists()
