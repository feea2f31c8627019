"""The client commands against a real collector on loopback: tables, --json, exit codes, export and import."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from typer.testing import CliRunner

import quantwatch.agent as qw
from quantwatch.cli import app
from quantwatch.client import ExitCode
from quantwatch.kernels import QuantLinear, QuantSpec

runner = CliRunner()

# 12 layers × 40 steps of output_rel_l2 less one hole, 12 × 40 underflow_ratio, 40 × (loss, loss_shadow).
EXPECTED_POINTS = 12 * 40 - 1 + 12 * 40 + 2 * 40


def invoke(collector: Any, *args: str) -> Any:
    return runner.invoke(app, [*args, "--url", collector.url])


def test_runs_as_json_and_as_a_table(collector: Any) -> None:
    result = invoke(collector, "runs", "--json")
    assert result.exit_code == 0, result.stderr
    runs = {run["name"]: run for run in json.loads(result.stdout)}
    assert runs[collector.run]["layer_count"] == len(collector.layers)
    assert runs[collector.run]["last_step"] == collector.steps - 1

    table = invoke(collector, "runs")
    assert table.exit_code == 0
    assert collector.run in table.stdout
    assert f"0–{collector.steps - 1}" in table.stdout


def test_series_matches_the_api(collector: Any) -> None:
    args = ["--metric", "output_rel_l2", "--layer", collector.bad_layer, "--start", "20", "--end", "30"]
    result = invoke(collector, "series", collector.run, *args, "--json")
    assert result.exit_code == 0, result.stderr
    api = httpx.get(
        f"{collector.url}/api/v1/runs/{collector.run}/series",
        params={"metric": "output_rel_l2", "layer": collector.bad_layer, "start": 20, "end": 30},
    ).json()
    assert json.loads(result.stdout) == api
    assert api["steps"] == list(range(20, 31))

    table = invoke(collector, "series", collector.run, *args)
    assert table.exit_code == 0
    lines = [line for line in table.stdout.splitlines() if line.strip("│ ").startswith(str(collector.drift_step))]
    assert lines, table.stdout
    # The value printed for the first drifting step is the API's, to 6 significant digits.
    value = api["mean"][api["steps"].index(collector.drift_step)]
    assert f"{value:.6g}" in lines[0]


def test_series_bucketed_and_scalar(collector: Any) -> None:
    bucketed = invoke(collector, "series", collector.run, "--scalar", "loss", "--max-points", "4")
    assert bucketed.exit_code == 0, bucketed.stderr
    api = httpx.get(
        f"{collector.url}/api/v1/runs/{collector.run}/series", params={"scalar": "loss", "max_points": 4}
    ).json()
    assert api["bucket_steps"] > 1
    assert f"buckets of {api['bucket_steps']} steps" in bucketed.stdout
    assert len(api["steps"]) <= 4
    assert "min" in bucketed.stdout
    assert "max" in bucketed.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["series", "no-such-run", "--scalar", "loss"], "404"),
        (["series", "RUN", "--metric", "output_rel_l2", "--layer", "no.such.layer"], "404"),
        (["export", "no-such-run", "--format", "csv"], "404"),
        (["alerts", "--run", "no-such-run"], "404"),
    ],
)
def test_unknown_things_exit_4(collector: Any, args: list[str], message: str) -> None:
    args = [collector.run if a == "RUN" else a for a in args]
    result = invoke(collector, *args)
    assert result.exit_code == ExitCode.NOT_FOUND, result.output
    assert message in result.stderr


def test_alerts_lists_the_firing_episode(collector: Any) -> None:
    result = invoke(collector, "alerts", "--run", collector.run, "--json")
    assert result.exit_code == 0, result.stderr
    alerts = json.loads(result.stdout)
    firing = [a for a in alerts if a["layer"] == collector.bad_layer]
    assert [a["state"] for a in firing] == ["firing"]
    assert firing[0]["firing"]["step"] == collector.drift_step + 2
    # Still firing at the run's last step: the episode row changed only when it fired, its series saw every step.
    assert firing[0]["step"] == collector.drift_step + 2
    assert firing[0]["latest_step"] == collector.steps - 1

    table = invoke(collector, "alerts", "--run", collector.run, "--state", "firing")
    assert table.exit_code == 0
    assert "quantwatch_output_deviation" in table.stdout
    (row,) = [line for line in table.stdout.splitlines() if collector.bad_layer in line]
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    header = next(line for line in table.stdout.splitlines() if "latest step" in line)
    columns = [cell.strip() for cell in header.strip("┃ ").split("┃")]
    assert cells[columns.index("fired at step")] == str(collector.drift_step + 2)
    assert cells[columns.index("latest step")] == str(collector.steps - 1)

    none = invoke(collector, "alerts", "--run", collector.run, "--state", "resolved")
    assert none.exit_code == 0
    assert "No alerts in state resolved" in none.stdout


def test_export_csv_and_parquet_hold_every_point(collector: Any, tmp_path: Path) -> None:
    csv_path = tmp_path / "run.csv"
    result = invoke(collector, "export", collector.run, "--format", "csv", "-o", str(csv_path))
    assert result.exit_code == 0, result.stderr
    rows = list(csv.reader(io.StringIO(csv_path.read_text())))
    assert len(rows) - 1 == EXPECTED_POINTS
    umask = os.umask(0)
    os.umask(umask)
    assert csv_path.stat().st_mode & 0o777 == 0o666 & ~umask

    to_stdout = invoke(collector, "export", collector.run)
    assert to_stdout.exit_code == 0
    assert to_stdout.stdout.splitlines() == csv_path.read_text().splitlines()

    import pyarrow.parquet as pq

    parquet_path = tmp_path / "run.parquet"
    result = invoke(collector, "export", collector.run, "--format", "parquet", "-o", str(parquet_path))
    assert result.exit_code == 0, result.stderr
    assert pq.read_table(parquet_path).num_rows == EXPECTED_POINTS


def test_export_into_a_pipe_closed_early_is_not_a_failure(collector: Any) -> None:
    # `quantwatch export RUN | head -c 100`: the reader closes the pipe after 100 bytes of the CSV.
    command = [
        sys.executable,
        "-m",
        "quantwatch.cli",
        "export",
        collector.run,
        "--format",
        "csv",
        "--url",
        collector.url,
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None
        assert process.stdout.read(100).startswith(b"rank,step,")
        process.stdout.close()
        stderr = process.stderr.read() if process.stderr else b""
        assert process.wait(timeout=60) == 0, stderr
    assert stderr == b""


def test_failed_export_leaves_no_file(collector: Any, tmp_path: Path) -> None:
    target = tmp_path / "missing.csv"
    result = invoke(collector, "export", "no-such-run", "-o", str(target))
    assert result.exit_code == ExitCode.NOT_FOUND
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JSON-lines file written by the agent's own file exporter while a tiny quantized model trains."""
    path = tmp_path_factory.mktemp("agent") / "run.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        QuantLinear(8, 16, weight=QuantSpec("fp4_e2m1"), input=QuantSpec("fp8_e4m3")),
        torch.nn.ReLU(),
        QuantLinear(16, 4, weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3")),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = qw.attach(model, run="imported/tiny", url=f"file://{path}", every=1, max_batch_steps=2)
    for step in range(6):
        x = torch.randn(32, 8)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        monitor.step(step, loss=loss.detach())
        monitor.flush()
    monitor.close()
    return path


def test_import_of_the_agent_file_is_idempotent(collector: Any, agent_file: Path) -> None:
    lines = [line for line in agent_file.read_text().splitlines() if line.strip()]
    assert len(lines) >= 2

    first = invoke(collector, "import", str(agent_file), "--json")
    assert first.exit_code == 0, first.stderr
    summary = json.loads(first.stdout)
    assert summary["batches"] == summary["stored"] == len(lines)
    assert summary["duplicates"] == 0
    assert summary["points"] > 0

    again = invoke(collector, "import", str(agent_file), "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout) == {"batches": len(lines), "stored": 0, "duplicates": len(lines), "points": 0}

    run = httpx.get(f"{collector.url}/api/v1/runs/imported/tiny").json()
    assert run["first_step"] == 0
    assert run["last_step"] == 5
    assert run["points"] == summary["points"]


def test_import_reads_gzip_files_and_standard_input(collector: Any, agent_file: Path, tmp_path: Path) -> None:
    lines = len([line for line in agent_file.read_text().splitlines() if line.strip()])
    gzipped = tmp_path / "run.jsonl.gz"
    gzipped.write_bytes(gzip.compress(agent_file.read_bytes()))
    for args, stdin in (([str(gzipped)], None), (["-"], agent_file.read_bytes())):
        result = runner.invoke(app, ["import", *args, "--json", "--url", collector.url], input=stdin)
        assert result.exit_code == 0, result.stderr
        summary = json.loads(result.stdout)
        # The batches are in the collector already (the idempotency test or an earlier pass): all recognised.
        assert summary["batches"] == lines
        assert summary["stored"] + summary["duplicates"] == lines


def test_import_stops_at_a_malformed_line_naming_it(collector: Any, tmp_path: Path, agent_file: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    first_line = agent_file.read_text().splitlines()[0]
    broken.write_text(first_line + "\n{not json\n")
    result = invoke(collector, "import", str(broken))
    assert result.exit_code == ExitCode.USAGE
    assert f"{broken}:2: not valid JSON" in result.stderr


def test_import_reports_a_batch_the_collector_refuses(collector: Any, tmp_path: Path) -> None:
    bad = {
        "run": "imported/bad",
        "rank": 0,
        "batch_id": "bad-1",
        "layers": ["a", "b"],
        "steps": [{"step": 0, "time": 1.0, "metrics": {"output_rel_l2": [0.1]}, "scalars": {}}],
    }
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    result = invoke(collector, "import", str(path))
    assert result.exit_code == ExitCode.REJECTED, result.output
    assert f"{path}:1:" in result.stderr
    assert "422" in result.stderr
    assert "output_rel_l2" in result.stderr


def test_auth_failures_exit_5(secured_collector: Any, agent_file: Path) -> None:
    no_token = invoke(secured_collector, "runs")
    assert no_token.exit_code == ExitCode.AUTH
    assert "401" in no_token.stderr
    assert "--token" in no_token.stderr

    wrong = invoke(secured_collector, "runs", "--token", "not-a-token")
    assert wrong.exit_code == ExitCode.AUTH

    read = runner.invoke(
        app, ["runs", "--json", "--url", secured_collector.url], env={"QUANTWATCH_TOKEN": secured_collector.read_token}
    )
    assert read.exit_code == 0, read.stderr
    assert [r["name"] for r in json.loads(read.stdout)] == [secured_collector.run]

    # A read token cannot ingest: 403.
    refused = invoke(secured_collector, "import", str(agent_file), "--token", secured_collector.read_token)
    assert refused.exit_code == ExitCode.AUTH
    assert "403" in refused.stderr
