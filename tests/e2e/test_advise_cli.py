"""``quantwatch advise`` against a real collector on loopback: the recipe in every format, and the exit codes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import yaml
from typer.testing import CliRunner

from quantwatch.cli import app
from quantwatch.client import ExitCode
from quantwatch.kernels import QuantSpec, Recipe
from tests.service.test_whatif import doc

runner = CliRunner()


def test_advise_prints_the_recipe_and_exits_like_the_other_commands(start_collector: Callable[..., Any]) -> None:
    server = start_collector()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/api/v1/ingest", json=doc("cli", [0, 10, 20])).raise_for_status()
        http.post("/api/v1/ingest", json=doc("bare", [1, 2])).raise_for_status()

    def advise(*args: str) -> Any:
        return runner.invoke(app, ["advise", *args, "--url", server.url])

    python = advise("cli", "--format", "python")
    assert python.exit_code == 0, python.stderr
    namespace: dict[str, Any] = {}
    exec(python.stdout, namespace)
    assert isinstance(namespace["recipe"], Recipe)
    assert namespace["recipe"].config_for("blocks.0.fc1").weight == QuantSpec("nvfp4")
    assert namespace["module_filter_fn"](None, "blocks.1.fc2") is False
    loose = advise("cli", "--budget", "weight=0.5,input=0.5,grad=0.5", "--format", "yaml")
    assert loose.exit_code == 0, loose.stderr
    assert yaml.safe_load(loose.stdout)["high_precision"] == []
    answer = json.loads(advise("cli", "--format", "json", "--window", "1").stdout)
    assert answer["steps"] == [20]
    assert answer["high_precision"] == ["blocks.1.fc2"]
    shown = advise("cli")
    assert shown.exit_code == 0, shown.stderr
    assert "blocks.1.fc2" in shown.stdout
    assert "nvfp4 (0.04)" in shown.stdout
    assert "high precision" in shown.stdout
    none = advise("bare")
    assert none.exit_code == 0
    assert "No what-if statistics for run bare" in none.stdout
    missing = advise("nope")
    assert missing.exit_code == ExitCode.NOT_FOUND
    assert "nope" in missing.stderr
    bad = advise("cli", "--budget", "grad=much")
    assert bad.exit_code == ExitCode.USAGE
    assert "--budget" in bad.stderr
