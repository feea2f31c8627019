"""promtool and amtool accept the shipped Prometheus and Alertmanager configuration, and the rule unit tests pass."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from quantwatch.service.alerts.rules import DEFAULT_RULES

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_config(promtool: str, tmp_path: Path) -> None:
    # promtool checks that the scrape token's credentials_file exists; docker-compose writes it at start, so the
    # check runs on a copy of the folder with that one path pointing at a stand-in file.
    folder = tmp_path / "prometheus"
    shutil.copytree(DASHBOARDS / "prometheus", folder)
    shipped = (folder / "prometheus.yml").read_text()
    assert "credentials_file: /prometheus/quantwatch.token" in shipped
    token = tmp_path / "quantwatch.token"
    token.write_text("stand-in")
    (folder / "prometheus.yml").write_text(shipped.replace("/prometheus/quantwatch.token", str(token)))
    result = run(promtool, "check", "config", str(folder / "prometheus.yml"))
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


def test_alerting_rules_are_the_collector_defaults_on_streak_gauges() -> None:
    groups = yaml.safe_load((DASHBOARDS / "prometheus" / "rules" / "quantwatch.rules.yml").read_text())["groups"]
    alerts = [rule for group in groups for rule in group["rules"] if "alert" in rule]
    by_rule = {}
    for alert in alerts:
        match = re.fullmatch(r'quantwatch_alert_streak_steps\{rule="(\w+)"\} >= (\d+)', alert["expr"])
        assert match, f"{alert['alert']}: {alert['expr']} is not a streak rule"
        by_rule[match.group(1)] = (int(match.group(2)), alert["labels"]["severity"])
    assert by_rule == {rule.name: (rule.consecutive, rule.severity) for rule in DEFAULT_RULES}
