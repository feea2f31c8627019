"""``quantwatch serve`` as a real subprocess on both backends."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from quantwatch.cli import app
from quantwatch.service.server import free_port


def test_quantwatch_serve_answers_on_loopback(database_url: str) -> None:
    port = free_port()
    env = {**os.environ, "QUANTWATCH_PORT": str(port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantwatch.cli", "serve", "--database-url", database_url, "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "collector did not start"
                time.sleep(0.2)
        assert r.status_code == 200
        assert r.json() == {"status": "ready"}
        body = b'{"run": "cli", "batch_id": "1", "layers": ["a"], "steps": [{"step": 0, "metrics": {"m": [1.5]}}]}'
        ok = httpx.post(
            f"http://127.0.0.1:{port}/api/v1/ingest", content=body, headers={"Content-Type": "application/json"}
        )
        assert ok.json() == {"batch_id": "1", "duplicate": False, "points": 1}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_freezes_what_startup_built_before_it_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The objects built at startup are moved out of the garbage collector's reach before uvicorn starts serving, so a
    # full collection does not walk them on every request's time.
    frozen_when_serving: list[int] = []

    def run(served: Any, **_options: Any) -> None:
        frozen_when_serving.append(gc.get_freeze_count())

    monkeypatch.setattr(uvicorn, "run", run)
    gc.unfreeze()
    try:
        result = CliRunner().invoke(app, ["serve", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/q.db"])
    finally:
        gc.unfreeze()
    assert result.exit_code == 0, result.output
    assert len(frozen_when_serving) == 1
    assert frozen_when_serving[0] > 10_000


def test_serve_help_lists_every_setting_with_its_environment_variable_and_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantwatch.service.core.config import Settings

    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    help_text = " ".join(result.output.split())  # click wraps option help: compare with the whitespace folded
    assert "[env var: QUANTWATCH_HOST; default: 127.0.0.1]" in help_text
    assert "[env var: QUANTWATCH_PORT; default: 8000]" in help_text
    assert "[env var: QUANTWATCH_DATABASE_URL; default: sqlite:///./quantwatch.db]" in help_text
    assert "[env var: QUANTWATCH_RULES_FILE; default: none]" in help_text
    assert "QUANTWATCH_MAX_PENDING_INGEST=64 " in help_text
    assert "QUANTWATCH_SQLITE_SYNCHRONOUS=FULL " in help_text
    for field in Settings.model_fields:
        assert f"QUANTWATCH_{field.upper()}" in help_text, field
    # The names shown are the ones the collector reads.
    monkeypatch.setenv("QUANTWATCH_METRICS_TOP_K", "7")
    assert Settings().metrics_top_k == 7


def test_serve_refuses_a_fold_chunks_value_that_is_not_a_boolean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantwatch.service.core.config import Settings

    monkeypatch.setenv("QUANTWATCH_FOLD_CHUNKS", "maybe")
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/q.db"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: fold_chunks: Input should be a valid boolean"), result.output
    assert not (tmp_path / "q.db").exists()
    monkeypatch.setenv("QUANTWATCH_FOLD_CHUNKS", "false")
    assert not Settings().fold_chunks
    monkeypatch.delenv("QUANTWATCH_FOLD_CHUNKS")
    assert Settings().fold_chunks  # on by default


def test_serve_takes_fold_chunks_from_its_flag_or_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_options: served.append(app))
    try:
        cases = ((["--fold-chunks"], "false"), ([], "false"), (["--no-fold-chunks"], "true"), ([], None))
        for args, env in cases:
            if env is None:
                monkeypatch.delenv("QUANTWATCH_FOLD_CHUNKS", raising=False)
            else:
                monkeypatch.setenv("QUANTWATCH_FOLD_CHUNKS", env)
            db = f"sqlite:///{tmp_path}/q{len(served)}.db"
            result = CliRunner().invoke(app, ["serve", "--port", "0", "--database-url", db, *args])
            assert result.exit_code == 0, result.output
    finally:
        gc.unfreeze()  # serve froze what it built
    assert [a.state.settings.fold_chunks for a in served] == [True, False, False, True]
    for a in served:
        a.state.engine.dispose()


def test_uvicorn_serves_the_collector_with_httptools_and_uvloop() -> None:
    """The collector's install brings httptools and uvloop, and uvicorn's "auto" choices (``quantwatch serve``,
    ``BackgroundServer``) take them: h11 and asyncio's loop cost a one-step ingest request ~0.3 ms CPU more."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert AutoHTTPProtocol is HttpToolsProtocol
    factory = uvicorn.Config(app=None).get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert type(loop).__module__.split(".")[0] == "uvloop"
    finally:
        loop.close()
