"""promtool and amtool accept the shipped Prometheus and Alertmanager configuration, and the rule unit tests pass."""

from __future__ import annotations

import subprocess
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_config(promtool: str) -> None:
    result = run(promtool, "check", "config", str(DASHBOARDS / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_promtool_check_rules(promtool: str) -> None:
    result = run(promtool, "check", "rules", str(DASHBOARDS / "prometheus" / "rules" / "quantwatch.rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_rule_unit_tests_pass(promtool: str) -> None:
    result = run(promtool, "test", "rules", str(DASHBOARDS / "prometheus" / "tests" / "quantwatch.rules.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_amtool_check_config(amtool: str) -> None:
    result = run(amtool, "check-config", str(DASHBOARDS / "alertmanager" / "alertmanager.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 receivers" in result.stdout
