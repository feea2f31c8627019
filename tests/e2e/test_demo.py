"""``quantwatch demo`` end to end, for a few steps: alerts, signatures, history, export, determinism."""

from __future__ import annotations

import csv
import inspect
import io
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import standardwebhooks
from rich.console import Console
from typer.testing import CliRunner

from quantwatch import cli
from quantwatch.demo import (
    DEFAULT_STEPS,
    PER_TENSOR_FP4_LAYER,
    UPDATE_RULE,
    DemoOptions,
    DemoResult,
    receiver_rules,
    run_demo,
)
from quantwatch.demo.report import print_stopped
from quantwatch.demo.run import next_free_port
from quantwatch.service import Settings, create_app
from quantwatch.service.alerts.rules import DEFAULT_RULES, RulesFile
from quantwatch.service.server import BackgroundServer, free_port, wait_until_ready

# The demo's own length: the per-tensor FP4 layer's update direction drifts past 5% around step 50 with the default seed
# (48 or 51 depending on the CPU's matmul rounding), well inside it.
STEPS = DEFAULT_STEPS
Run = tuple[DemoResult, dict[str, Any], str]


def _run(tmp_path: Path, name: str, *, remediate: bool = False) -> Run:
    seen: dict[str, Any] = {}

    def while_serving(result: DemoResult) -> None:
        # Queried while the demo's own collector is still up.
        with httpx.Client(base_url=result.url, timeout=30) as http:
            seen["layers_info"] = http.get("/api/v1/runs/demo/layers").json()
            seen["layers"] = [x["name"] for x in seen["layers_info"]]
            seen["heatmap"] = http.get(
                "/api/v1/runs/demo/heatmap", params={"metric": "output_rel_l2", "max_steps": STEPS}
            ).json()
            seen["update_cosine"] = http.get(
                "/api/v1/runs/demo/series", params={"metric": "update_cosine", "layer": PER_TENSOR_FP4_LAYER}
            ).json()
            seen["run"] = http.get("/api/v1/runs/demo").json()
            seen["export"] = http.get("/api/v1/runs/demo/export", params={"format": "csv"}).text
            seen["page"] = http.get("/").text
            seen["metrics"] = http.get("/metrics").text

    out = io.StringIO()
    seen["database"] = tmp_path / f"{name}.db"
    result = run_demo(
        DemoOptions(steps=STEPS, port=0, database=seen["database"], remediate=remediate),
        Console(file=out, width=200),
        while_serving=while_serving,
    )
    return result, seen, out.getvalue()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory.mktemp("demo"), "first")


def _first_streak_end(values: list[float], threshold: float, length: int) -> int:
    """Index of the sample that completes the first run of ``length`` consecutive values below ``threshold``."""
    streak = 0
    for index, value in enumerate(values):
        streak = streak + 1 if value < threshold else 0
        if streak == length:
            return index
    raise AssertionError(f"no {length} consecutive values below {threshold}: {values}")


def test_demo_fires_the_expected_alert_once_with_a_valid_signature(first_run: Run) -> None:
    result, seen, printed = first_run

    # The per-tensor FP4 layer's update direction drifts more than 5% off FP32: one alert in the whole run, on that
    # layer, one firing webhook, signed. Every other layer stays inside every rule.
    assert [(a["rule"], a["layer"], a["state"]) for a in result.alerts] == [
        (UPDATE_RULE, PER_TENSOR_FP4_LAYER, "firing")
    ]
    assert [(n.status, n.details.get("rule"), n.details.get("layer")) for n in result.notifications] == [
        ("firing", UPDATE_RULE, PER_TENSOR_FP4_LAYER)
    ]
    notification = result.notifications[0]
    assert notification.signature_valid
    # It fired at the third consecutive step below 0.95, as the stored history shows.
    history = seen["update_cosine"]
    assert history["steps"] == list(range(STEPS))
    fired_step = _first_streak_end(history["mean"], 0.95, 3)
    assert fired_step > 10  # a drift, not a bad start
    assert notification.details["step"] == fired_step
    assert notification.details["value"] == pytest.approx(history["mean"][fired_step], rel=1e-6)
    # An independent implementation of Standard Webhooks agrees with the demo's verifier.
    assert result.webhook_secret is not None
    verified = standardwebhooks.Webhook(result.webhook_secret).verify(notification.raw_body, notification.headers)
    assert verified["quantwatch"]["layer"] == PER_TENSOR_FP4_LAYER
    assert len({n.webhook_id for n in result.notifications}) == len(result.notifications)
    assert all(n.signature_valid for n in result.notifications)

    assert result.alerts[0]["firing"]["step"] == fired_step

    # The history API holds every step of every monitored layer.
    heatmap = seen["heatmap"]
    assert heatmap["bucket_steps"] == 1
    assert heatmap["steps"] == list(range(STEPS))
    assert heatmap["layers"] == seen["layers"]
    assert PER_TENSOR_FP4_LAYER in heatmap["layers"]
    assert all(v is not None for row in heatmap["values"] for v in row)

    # The export holds every point the agent sent.
    rows = list(csv.reader(io.StringIO(seen["export"])))
    assert len(rows) - 1 == result.points_sent == seen["run"]["points"]

    # Prometheus sees the run: the latest deviation of the per-tensor FP4 layer, equal to the history's last value.
    series = f'quantwatch_layer_output_rel_l2_ratio{{layer="{PER_TENSOR_FP4_LAYER}",rank="0",run="demo"}} '
    exposed = [line for line in seen["metrics"].splitlines() if line.startswith(series)]
    assert len(exposed) == 1, seen["metrics"][:2000]
    latest = heatmap["values"][heatmap["layers"].index(PER_TENSOR_FP4_LAYER)][-1]
    assert float(exposed[0].removeprefix(series)) == pytest.approx(latest, rel=1e-6)

    assert "QuantWatch" in seen["page"]
    assert f"{result.url}/#run=demo" in printed
    assert f"{result.url}/#run=demo&metric=update_cosine&layer={PER_TENSOR_FP4_LAYER}&step={fired_step}" in printed
    assert PER_TENSOR_FP4_LAYER in printed
    assert "signature ok" in printed


def test_the_printed_serve_command_shows_the_history_with_the_shipped_rules_and_alert(first_run: Run) -> None:
    _, seen, printed = first_run
    database = seen["database"]
    assert f"quantwatch serve --database-url sqlite:///{database} --port" in printed
    assert "--rules" not in printed
    assert not database.with_name(f"{database.stem}.rules.yaml").exists()  # no rules file of its own any more
    # Served again as printed (a fresh collector on the kept database, no rules file), nothing of the demo is retired.
    settings = Settings(database_url=f"sqlite:///{database}")
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        rules = {rule["name"]: rule for rule in http.get("/api/v1/rules").json()}
        assert sorted(rules) == sorted(rule.name for rule in DEFAULT_RULES)
        assert rules[UPDATE_RULE]["source"] == "default"
        alerts = http.get("/api/v1/alerts", params={"run": "demo"}).json()
        assert [(a["rule"], a["layer"], a["state"]) for a in alerts] == [(UPDATE_RULE, PER_TENSOR_FP4_LAYER, "firing")]
        assert http.get("/api/v1/receivers").json() == []  # the demo's in-process receiver is gone with it


@pytest.fixture(scope="module")
def remediated_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory.mktemp("demo"), "remediated", remediate=True)


def test_demo_remediate_moves_the_failing_layer_to_fp8_and_its_alert_resolves(
    first_run: Run, remediated_run: Run
) -> None:
    first, seen_first, _ = first_run
    result, seen, printed = remediated_run
    fired = first.alerts[0]["firing"]["step"]
    # The same seed fires at the same step; the answer to that step's batch names the episode, and the callback
    # acts at the next step's boundary (the demo flushes every step, so that is the same step every run).
    [alert] = result.alerts
    assert (alert["rule"], alert["layer"], alert["firing"]["step"]) == (UPDATE_RULE, PER_TENSOR_FP4_LAYER, fired)
    acted = fired + 1
    assert [(a["step"], a["action"], a["layer"], a["episode"]) for a in result.actions] == [
        (acted, "keep_high_precision", PER_TENSOR_FP4_LAYER, alert["id"])
    ]
    assert result.actions[0]["detail"] == (
        "weight fp4_e2m1:tensor → fp8_e4m3:tensor; input fp4_e2m1:tensor → fp8_e4m3:tensor; "
        "grad fp4_e2m1:tensor → fp8_e5m2:tensor"
    )
    # Until the action both runs are the same run, value for value; after it the layer's update direction recovers
    # (it had stayed below 0.95 without the action), and the episode resolves.
    before = acted + 1
    assert [row[:before] for row in seen["heatmap"]["values"]] == [
        row[:before] for row in seen_first["heatmap"]["values"]
    ]
    cosine, unremediated = seen["update_cosine"]["mean"], seen_first["update_cosine"]["mean"]
    assert min(cosine[acted + 1 :]) >= 0.95
    assert min(unremediated[acted + 1 :]) < 0.95
    assert alert["state"] == "resolved"
    assert alert["resolved"]["step"] > acted
    assert [n.status for n in result.notifications] == ["firing", "resolved"]
    # The collector knows the layer's formats from then on, and the summary says what was done when.
    formats = {x["name"]: x for x in seen["layers_info"]}[PER_TENSOR_FP4_LAYER]
    assert formats["formats"] == {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
    assert "actions taken on the training job" in printed
    assert re.search(rf"{acted}\s+│ keep_high_precision │ {re.escape(PER_TENSOR_FP4_LAYER)}", printed)


def test_demo_is_deterministic_for_a_seed(first_run: Run, tmp_path: Path) -> None:
    first, seen_first, _ = first_run
    second, seen_second, _ = _run(tmp_path, "second")

    def alerts(result: DemoResult) -> list[tuple[str, str | None, int | None]]:
        return sorted((a["rule"], a["layer"], (a["firing"] or {}).get("step")) for a in result.alerts)

    assert alerts(first) == alerts(second)
    assert alerts(first)
    assert seen_first["heatmap"]["values"] == seen_second["heatmap"]["values"]


# The demo on the shipped rules beyond the default run (mixed, seed 0), seeds 0-2 of every recipe: the per-tensor FP4
# layer fires for the other seeds too (at step 37 and 34 on our machine, so 48 steps leave a margin for the CPU's
# rounding), and the healthy recipes fire nothing over the demo's whole length.
SHIPPED_RULE_RUNS = [
    ("mixed", 1, 48),
    ("mixed", 2, 48),
    *((recipe, seed, STEPS) for recipe in ("fp4", "fp8") for seed in range(3)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "seed", "steps"), SHIPPED_RULE_RUNS)
def test_on_the_shipped_rules_only_the_per_tensor_fp4_layer_fires(
    recipe: str, seed: int, steps: int, tmp_path: Path
) -> None:
    options = DemoOptions(steps=steps, recipe=recipe, seed=seed, port=0, database=tmp_path / "demo.db")
    result = run_demo(options, Console(file=io.StringIO(), width=200))
    fired = {(a["rule"], a["layer"]) for a in result.alerts}
    if recipe == "mixed":
        assert (UPDATE_RULE, PER_TENSOR_FP4_LAYER) in fired
        assert {layer for _, layer in fired} == {PER_TENSOR_FP4_LAYER}, fired  # no healthy layer
        assert all(n.signature_valid for n in result.notifications)
    else:
        assert fired == set()
        assert result.notifications == []
    assert result.summary["run"]["last_step"] == steps - 1  # it ran the whole length


def test_demo_command_defaults_match_the_module_and_bad_options_exit_2() -> None:
    assert inspect.signature(cli.demo).parameters["steps"].default == DEFAULT_STEPS
    runner = CliRunner()
    result = runner.invoke(cli.app, ["demo", "--recipe", "int3"])
    assert result.exit_code == 2
    assert "--recipe must be one of mixed, fp8, fp4" in result.stderr
    result = runner.invoke(cli.app, ["demo", "--url", "nowhere"])
    assert result.exit_code == 2
    assert "--url must be an http" in result.stderr


def test_demo_sends_to_an_existing_collector_with_url(collector: Any) -> None:
    out = io.StringIO()
    result = run_demo(DemoOptions(steps=3, url=collector.url), Console(file=out, width=200))
    assert result.run.startswith("demo-mixed-seed0-")
    assert result.notifications == []
    assert result.webhook_secret is None
    run = httpx.get(f"{collector.url}/api/v1/runs/{result.run}").json()
    assert run["last_step"] == 2
    assert run["points"] == result.points_sent > 0
    assert f"{collector.url}/#run={result.run}" in out.getvalue()


def test_demo_command_keeps_serving_until_interrupted(tmp_path: Path) -> None:
    # The real console script: trains, prints the summary, then serves the web view until Ctrl-C (SIGINT).
    command = [
        sys.executable, "-m", "quantwatch.cli", "demo", "--steps", "3", "--keep-serving", "--port", "0",
        "--database", str(tmp_path / "demo.db"),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        printed = "".join(lines)
        url = re.search(r"stay up at (http://127\.0\.0\.1:\d+)/", printed)
        assert url is not None, printed
        assert "QuantWatch" in httpx.get(url.group(1) + "/").text
        assert httpx.get(url.group(1) + "/api/v1/runs/demo").json()["last_step"] == 2
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert (tmp_path / "demo.db").exists()


def test_the_demos_rules_file_holds_its_receiver_and_leaves_the_shipped_rules_as_they_are() -> None:
    rules_file = RulesFile.model_validate(receiver_rules("http://127.0.0.1:9/hook", "whsec_" + "A" * 32))
    assert rules_file.effective_rules() == list(DEFAULT_RULES)
    assert [receiver.name for receiver in rules_file.receivers] == ["demo-webhook"]


def _serve_command(printed: str) -> tuple[str, str, list[str]]:
    """From the demo's output: the URL its collector had, the port, and the printed serve command's words."""
    stopped = re.search(r"The demo's collector at (http://127\.0\.0\.1:(\d+)) has stopped", printed)
    assert stopped is not None, printed
    again = re.search(r"See the run again with (quantwatch serve .+?) and open (\S+)", printed)
    assert again is not None, printed
    assert again.group(2) == f"{stopped.group(1)}/#run=demo"
    return stopped.group(1), stopped.group(2), shlex.split(again.group(1))


def test_the_demo_says_its_collector_stopped_and_its_command_serves_the_run_from_anywhere(
    first_run: Run, tmp_path: Path
) -> None:
    result, _, printed = first_run
    url, port, argv = _serve_command(printed)
    assert url == result.url
    assert argv[argv.index("--port") + 1] == port
    command = [sys.executable, "-m", "quantwatch.cli", *argv[1:], "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_ready(process, f"{url}/readyz", 60, "the demo's printed serve command")
        assert httpx.get(f"{url}/api/v1/runs/demo").json()["last_step"] == STEPS - 1
        alerts = httpx.get(f"{url}/api/v1/alerts", params={"run": "demo"}).json()
        assert [(a["rule"], a["state"]) for a in alerts] == [(UPDATE_RULE, "firing")]
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert not list(tmp_path.iterdir())  # it served the demo's files, created none where it ran


def test_the_printed_command_names_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default database is relative (./quantwatch-demo.db): the command must work from another directory too.
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    print_stopped(Console(file=out, width=300), "http://127.0.0.1:8123", Path("quantwatch-demo.db"), 8123)
    _, port, argv = _serve_command(out.getvalue())
    assert port == "8123"
    assert argv[argv.index("--database-url") + 1] == f"sqlite:///{tmp_path / 'quantwatch-demo.db'}"
    assert "--rules" not in argv  # the shipped rules, the collector's default, are the demo's
    assert argv[argv.index("--port") + 1] == "8123"


def test_the_demo_takes_the_next_free_port_when_its_port_is_taken() -> None:
    taken = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        chosen = next_free_port(taken)
    assert chosen > taken
    assert chosen - taken < 100  # the next free one, not one picked at random


def test_demo_url_with_a_token_lacking_a_scope_exits_5_before_training(secured_collector: Any) -> None:
    result = CliRunner().invoke(
        cli.app, ["demo", "--url", secured_collector.url, "--token", secured_collector.ingest_token, "--steps", "3"]
    )
    assert result.exit_code == 5, result.output
    assert "read and ingest scopes" in result.stderr
    assert "read: 403" in result.stderr
    assert "Traceback" not in result.output
    assert "training" not in result.stdout  # no progress bar: it stopped before the first step
    headers = {"Authorization": f"Bearer {secured_collector.read_token}"}
    runs = httpx.get(f"{secured_collector.url}/api/v1/runs", headers=headers).json()
    assert not [r for r in runs if r["name"].startswith("demo-")]


README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
README_TOLERANCE = 0.10
"""How far (relative) the demo's figures may be from those the README states: the CPU's matmul rounding moves them."""


def test_the_readme_states_the_demos_figures(first_run: Run) -> None:
    """The README's "What it shows" figures are the default demo's, as its summary reports them."""
    result, _, _ = first_run
    shows = re.search(r"^What it shows\.(.*?)\n\n", README, flags=re.MULTILINE | re.DOTALL)
    assert shows is not None
    text = " ".join(shows.group(1).split())
    assert "within 10%" in text  # the tolerance the README states is this test's
    tops = re.search(r"tops the summary on activation error \(≈(\d+)%\), underflow \(≈(\d+)%.*?\(≈(\d+)%\)", text)
    assert tops is not None, text
    for metric, stated in zip(("act_rel_l2", "underflow_ratio", "weight_drift_rel_l2"), tops.groups(), strict=True):
        value, layer = result.summary["worst"][metric][0]
        assert layer == PER_TENSOR_FP4_LAYER, metric
        assert abs(value * 100 - int(stated)) <= README_TOLERANCE * int(stated), (metric, value, stated)
    around = re.search(r"fires once, around step (\d+)", text)
    assert around is not None
    assert abs(result.alerts[0]["firing"]["step"] - int(around.group(1))) <= README_TOLERANCE * int(around.group(1))
    loss = re.search(
        r"the final loss stays within (\d+)% of the shadow's \(\+([\d.]+)% to \+([\d.]+)%", " ".join(README.split())
    )
    assert loss is not None
    scalars = result.summary["scalars"]
    gap = scalars["loss"]["mean"][-1] / scalars["loss_shadow"]["mean"][-1] - 1
    assert abs(gap) < int(loss.group(1)) / 100
    low, high = float(loss.group(2)), float(loss.group(3))
    assert (1 - README_TOLERANCE) * low <= gap * 100 <= (1 + README_TOLERANCE) * high, gap
