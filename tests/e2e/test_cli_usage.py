"""The client commands' promises that hold without a collector: help, argument errors, an unreachable collector."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantwatch.cli import app
from quantwatch.client import ExitCode

runner = CliRunner()

CLIENT_COMMANDS = ["runs", "alerts", "series", "advise", "export", "import"]


def _closed_port_url() -> str:
    # Bind, then close: nothing listens on that port afterwards, so a connection is refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_every_client_command_has_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "--url" in result.output
    assert "Usage:" in result.output


def test_top_level_help_documents_the_exit_codes() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for code in ExitCode:
        assert f"  {int(code)}  " in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["runs"], "cannot reach the collector"),
        (["alerts", "--run", "r"], "cannot reach the collector"),
        (["series", "r", "--metric", "output_rel_l2", "--layer", "fc1"], "cannot reach the collector"),
        (["export", "r", "--format", "csv"], "cannot reach the collector"),
        (["advise", "r"], "cannot reach the collector"),
    ],
)
def test_unreachable_collector_exits_3_with_a_clear_message(args: list[str], message: str) -> None:
    url = _closed_port_url()
    result = runner.invoke(app, [*args, "--url", url])
    assert result.exit_code == ExitCode.UNREACHABLE
    assert message in result.stderr
    assert url in result.stderr


def test_import_into_unreachable_collector_exits_3(tmp_path: Path) -> None:
    batches = tmp_path / "batches.jsonl"
    batches.write_text('{"run": "r", "rank": 0, "batch_id": "b1", "layers": [], "steps": []}\n')
    result = runner.invoke(app, ["import", str(batches), "--url", _closed_port_url()])
    assert result.exit_code == ExitCode.UNREACHABLE
    assert "cannot reach the collector" in result.stderr
    assert "re-running the import is safe" in result.stderr


def test_url_from_environment_is_used() -> None:
    url = _closed_port_url()
    result = runner.invoke(app, ["runs"], env={"QUANTWATCH_URL": url})
    assert result.exit_code == ExitCode.UNREACHABLE
    assert url in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["runs", "--url", "ftp://example.org"], "--url must be an http:// or https:// URL"),
        (["series", "r", "--metric", "output_rel_l2"], "give --metric and --layer"),
        (["series", "r", "--scalar", "loss", "--metric", "output_rel_l2"], "not both"),
        (["series", "r", "--scalar", "loss", "--start", "10", "--end", "5"], "--start (10) is after --end (5)"),
        (["series", "r", "--scalar", "loss", "--max-points", "0"], "--max-points"),
        (["series", "r", "--scalar", "loss", "--rank", "-1"], "--rank"),
        (["alerts", "--state", "exploded"], "--state"),
        (["export", "r", "--format", "xlsx"], "--format"),
        (["advise", "r", "--format", "toml"], "--format"),
        (["advise", "r", "--budget", "0.05,activation=0.1"], "--budget: unknown tensor kind 'activation'"),
        (["series"], "RUN"),
        (["import"], "FILE"),
        (["runs", "--timeout", "0"], "--timeout"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert message in result.stderr


def test_import_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["import", str(tmp_path / "nope.jsonl"), "--url", _closed_port_url()])
    assert result.exit_code == ExitCode.USAGE
    assert "nope.jsonl is not a readable file" in result.stderr


def test_console_script_exit_code_reaches_the_shell() -> None:
    # The real entry point in a fresh interpreter, not the in-process runner.
    url = _closed_port_url()
    out = subprocess.run(
        [sys.executable, "-m", "quantwatch.cli", "runs", "--url", url], capture_output=True, text=True, check=False
    )
    assert out.returncode == ExitCode.UNREACHABLE
    assert "cannot reach the collector" in out.stderr


def test_importing_the_cli_stays_light() -> None:
    # `quantwatch --help` must answer at once: commands import their heavy dependencies when they run.
    heavy = ("httpx", "torch", "rich.table", "fastapi", "sqlalchemy", "numpy")
    code = f"import sys, quantwatch.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
