"""The README's commands and code, run as written (placeholders filled in), so the README cannot drift from the code.

Every shell command of the README must be claimed by :data:`COVERAGE` (a new one fails
:func:`test_every_readme_command_is_run_or_validated` until a test runs it), and every Python block runs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from typer.testing import CliRunner

import quantwatch.agent as qw
from quantwatch.cli import app
from quantwatch.demo import PER_TENSOR_FP4_LAYER, TinyTransformer, make_recipe
from quantwatch.kernels import QuantLinear, quantize_model
from quantwatch.service.server import free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()

# How each README command is exercised: by a test of this file, or (Docker cannot run here) validated elsewhere.
COVERAGE = {
    "make demo": "test_make_targets_run_the_readme_commands (and tests/e2e/test_demo.py runs the demo itself)",
    "make test": "test_make_test_installs_the_debian_packages_it_needs_or_says_how (and .ci/run runs it on every push)",
    "quantwatch runs": "test_readme_client_commands",
    "quantwatch series": "test_readme_client_commands",
    "quantwatch alerts": "test_readme_client_commands",
    "quantwatch export": "test_readme_client_commands",
    "quantwatch advise": "test_readme_client_commands",
    "quantwatch import": "test_readme_client_commands",
    "quantwatch serve": "test_readme_serve_commands",
    "quantwatch db upgrade": "test_readme_db_commands",
    "quantwatch db retention": "test_readme_db_commands",
    "cp .env.example .env": "tests/dashboards/test_compose.py (every variable of the compose file is in .env.example)",
    "docker compose up -d --build": "tests/dashboards/test_compose.py (Compose schema, mounted paths, Dockerfile)",
}


def fenced_blocks(language: str) -> list[str]:
    """The README's fenced code blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)


def section(heading: str) -> str:
    """The README's ``## heading`` section, up to the next ``## `` heading."""
    start = README.index(f"\n## {heading}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def python_blocks(heading: str) -> list[str]:
    """The ``python`` blocks of one section, in order."""
    return re.findall(r"^```python\n(.*?)^```", section(heading), flags=re.MULTILINE | re.DOTALL)


# Every Python block of the README, by section; the test of each section runs them.
PYTHON_SECTIONS = ("Attaching the agent", "Attach to your own model", "Kernels")


def shell_commands() -> list[str]:
    """Every command line of the README's ``sh`` blocks, comments and blank lines left out."""
    lines = (line.split("#", 1)[0].strip() for block in fenced_blocks("sh") for line in block.splitlines())
    return [line for line in lines if line]


def expand(command: str) -> list[list[str]]:
    """Argument lists for one README command line: ``[optional …]`` parts included, one list per ``a|b`` choice."""
    words = shlex.split(command.replace("[", " ").replace("]", " "))
    choices = [word.split("|") if "|" in word and not word.startswith("http") else [word] for word in words]
    return [list(chosen) for chosen in itertools.product(*choices)]


def covered_by(command: str) -> str | None:
    return next((COVERAGE[head] for head in sorted(COVERAGE, key=len, reverse=True) if command.startswith(head)), None)


def test_every_readme_command_is_run_or_validated() -> None:
    commands = shell_commands()
    assert len(commands) >= 12
    assert [c for c in commands if covered_by(c) is None] == []
    # Each claim names a test that exists.
    here = Path(__file__).read_text()
    for claim in COVERAGE.values():
        name = claim.split(" ", 1)[0]
        assert (name.startswith("tests/") and (REPO / name).exists()) or f"def {name}(" in here, claim


def test_make_targets_run_the_readme_commands() -> None:
    # `make -n` prints the recipe without running it (the suite itself runs under `make test`).
    demo = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^\.venv/bin/quantwatch demo$", demo, flags=re.MULTILINE), demo
    test = subprocess.run(
        ["make", "--no-print-directory", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for tool in ("ruff check .", "ruff format --check .", "mypy", "python -m pytest"):
        assert tool in test, test
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.MULTILINE)
    # make test sets up the system itself, before anything else runs; CI then runs nothing but make test.
    assert test.splitlines()[0] == ".ci/system-packages", test
    assert [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd ", "export "))] == [
        "make test"
    ]


def _fake_bin(folder: Path, programs: dict[str, str]) -> dict[str, str]:
    """A PATH of only ``programs`` (name: shell body), so the script sees exactly the binaries a test gives it."""
    folder.mkdir()
    for name, body in programs.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return {"PATH": str(folder)}


def test_make_test_installs_the_debian_packages_it_needs_or_says_how(tmp_path: Path) -> None:
    script = ["/bin/bash", str(REPO / ".ci" / "system-packages")]
    needed = "prometheus prometheus-alertmanager chromium"
    log = tmp_path / "apt.log"
    apt = {"apt-get": f'echo "$@" >> {log}'}

    # As root with apt-get: installs what is missing.
    root = subprocess.run(script, env=_fake_bin(tmp_path / "root", {**apt, "id": "echo 0"}), capture_output=True)
    assert root.returncode == 0, root.stderr
    assert log.read_text().splitlines() == ["update", f"install -y {needed}"]
    log.unlink()

    # Not root: stops (before any test) with the one command to run.
    user = subprocess.run(script, env=_fake_bin(tmp_path / "user", {**apt, "id": "echo 1000"}), capture_output=True)
    assert user.returncode == 1
    assert f"sudo apt-get install -y {needed}" in user.stderr.decode()
    assert not log.exists()

    # Everything there: nothing to do.
    present = dict.fromkeys(("prometheus", "promtool", "amtool", "prometheus-alertmanager", "chromium"), "exit 0")
    done = subprocess.run(script, env=_fake_bin(tmp_path / "done", {**apt, **present, "id": "echo 0"}))
    assert done.returncode == 0
    assert not log.exists()


def test_readme_client_commands(collector: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The run the README's commands name: `demo`, with the demo's model and the layer they query, recorded by the
    # agent into a JSON-lines file the way the README says (`attach(url="file:///run.jsonl")`).
    monkeypatch.chdir(tmp_path)
    transformer = quantize_model(TinyTransformer(), make_recipe("mixed"))
    monitor = qw.attach(transformer, run="demo", url=f"file://{tmp_path / 'run.jsonl'}", every=1)
    tokens = torch.randint(0, 32, (2, 8))
    for step in range(3):
        transformer(tokens).sum().backward()
        monitor.step(step, loss=float(step))
    assert monitor.close(timeout_seconds=30)
    env = {"QUANTWATCH_URL": collector.url}
    client_commands = [c for c in shell_commands() if covered_by(c) == "test_readme_client_commands"]
    # import first: it stores the run the other commands read.
    client_commands.sort(key=lambda c: not c.startswith("quantwatch import"))
    ran = 0
    for command in client_commands:
        for argv in expand(command):
            assert argv[0] == "quantwatch"
            result = CliRunner().invoke(app, argv[1:], env=env)
            assert result.exit_code == 0, (argv, result.stdout, result.stderr)
            written = Path("FILE")
            if "-o" in argv:
                assert written.stat().st_size > 0, argv
                written.unlink()
            else:
                assert result.stdout.strip(), argv
            ran += 1
    assert ran >= 9
    layers = httpx.get(f"{collector.url}/api/v1/runs/demo/layers").json()
    assert PER_TENSOR_FP4_LAYER in [layer["name"] for layer in layers]


def _serve(argv: list[str], cwd: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "QUANTWATCH_PORT": str(port)}
    command = [sys.executable, "-m", "quantwatch.cli", *argv[1:], "--log-level", "warning"]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_readme_serve_commands(tmp_path: Path, postgres_session_url: str) -> None:
    serve = [expand(c)[0] for c in shell_commands() if c.startswith("quantwatch serve")]
    assert len(serve) == 2
    plain, secured = serve

    # `quantwatch serve`: loopback, ./quantwatch.db, no tokens (the port comes from QUANTWATCH_PORT).
    port = free_port()
    process = _serve(plain, tmp_path, port)
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/readyz", 60, "quantwatch serve")
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/runs").json() == []
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert (tmp_path / "quantwatch.db").exists()

    # The production line: every interface, a token file, PostgreSQL (the README's host `db` is the test server here).
    position = secured.index("--database-url") + 1
    assert secured[position].startswith("postgresql+psycopg://")
    secured[position] = postgres_session_url
    (tmp_path / secured[secured.index("--token-file") + 1]).write_text("s3cret read\n")
    port = free_port()
    process = _serve(secured, tmp_path, port)
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/readyz", 60, "quantwatch serve --host 0.0.0.0")
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/runs").status_code == 401
        answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/runs", headers={"Authorization": "Bearer s3cret"})
        assert answer.status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_readme_db_commands(tmp_path: Path) -> None:
    """The README's `db upgrade`, then its `db retention` pass on the upgraded database (nothing due there)."""
    url = f"sqlite:///{tmp_path / 'upgraded.db'}"
    for head in ("quantwatch db upgrade", "quantwatch db retention"):
        (command,) = [c for c in shell_commands() if c.startswith(head)]
        argv = [url if word == "…" else word for word in expand(command)[0]]
        result = CliRunner().invoke(app, argv[1:])
        assert result.exit_code == 0, result.stdout + result.stderr
        assert (tmp_path / "upgraded.db").stat().st_size > 0
    assert "0 raw points" in result.stdout, result.stdout


def test_every_python_block_is_run() -> None:
    assert fenced_blocks("python") == [block for heading in PYTHON_SECTIONS for block in python_blocks(heading)]


def test_readme_python_blocks_run(collector: Any) -> None:
    (attach_block,) = python_blocks("Attaching the agent")
    (kernels_block,) = python_blocks("Kernels")

    # Attaching the agent: the README's loop, with a model, data and optimizer of its kind, against a live collector.
    net = quantize_model(TinyTransformer(), make_recipe("mixed"))
    tokens = torch.randint(0, 32, (4, 9))
    loader = [SimpleNamespace(x=tokens[:, :-1], y=tokens[:, 1:]) for _ in range(12)]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    assert '"http://127.0.0.1:8000"' in attach_block
    namespace: dict[str, Any] = {
        "model": net,
        "loader": loader,
        "loss_fn": loss_fn,
        "opt": torch.optim.SGD(net.parameters(), lr=0.01),
    }
    exec(attach_block.replace('"http://127.0.0.1:8000"', repr(collector.url)), namespace)
    # every=10 over 12 steps: the layers' figures at the sampled steps 0 and 10, the loss at every step (issue 22).
    run = httpx.get(f"{collector.url}/api/v1/runs/gpt-fp4-a").json()
    assert run["last_step"] == 11
    layer = httpx.get(
        f"{collector.url}/api/v1/runs/gpt-fp4-a/series", params={"metric": "output_rel_l2", "layer": "head"}
    )
    assert layer.json()["steps"] == [0, 10]
    loss = httpx.get(f"{collector.url}/api/v1/runs/gpt-fp4-a/series", params={"scalar": "loss"}).json()
    assert loss["steps"] == list(range(12))

    # Kernels: quantize, fused statistics, and a model converted by rules (last layer FP8, the rest NVFP4).
    namespace = {}
    exec(kernels_block, namespace)
    converted = namespace["model"]
    assert isinstance(converted[0], QuantLinear)
    assert isinstance(converted[2], QuantLinear)
    assert converted[0].weight_quantizer.spec.fmt == "nvfp4"
    assert converted[2].weight_quantizer.spec.fmt.startswith("fp8")
    assert namespace["q"].shape == namespace["x"].shape


def test_readme_lists_every_attach_option() -> None:
    import inspect
    import re

    from quantwatch.agent import attach

    table = README[README.index("Every option of `attach()`") :]
    table = table[: table.index("\n\n", table.index("| option |"))]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert sorted(listed) == sorted(inspect.signature(attach).parameters)


# Runs blocks in order in one namespace; a marker line on both streams before each, so output is told apart per block.
_WALK_THROUGH_DRIVER = """
import json, sys
namespace = {}
for index, block in enumerate(json.load(sys.stdin)):
    for stream in (sys.stdout, sys.stderr):
        print(f"@@block {index}", file=stream, flush=True)
    exec(compile(block, f"README block {index}", "exec"), namespace)
"""


def _per_block(output: str, count: int) -> list[list[str]]:
    parts = re.split(r"^@@block \d+\n", output, flags=re.MULTILINE)
    assert len(parts) == count + 1, output
    return [part.splitlines() for part in parts[1:]]


def _printed(block: str) -> list[str]:
    """What a block says it prints: its ``# → …`` lines, as patterns (``…`` stands for what varies)."""
    expected = re.findall(r"^# → (.*)$", block, flags=re.MULTILINE)
    return [re.escape(line).replace("…", ".+") for line in expected]


def test_readme_walk_through_runs_as_printed() -> None:
    # The "Attach to your own model" walk-through, with the real torch and torchao, in a fresh interpreter.
    pytest.importorskip("torchao")
    blocks = python_blocks("Attach to your own model")
    assert len(blocks) == 4
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _WALK_THROUGH_DRIVER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    stdout, stderr = _per_block(done.stdout, len(blocks)), _per_block(done.stderr, len(blocks))
    for block, printed in zip(blocks, stdout, strict=True):
        patterns = _printed(block)
        assert patterns, block
        assert len(printed) == len(patterns), (printed, block)
        for line, pattern in zip(printed, patterns, strict=True):
            assert re.fullmatch(pattern, line), (line, block)
    # A plain model: warned, with the way out; every converted one: found and measured without a warning or failure.
    agent_lines = [[line for line in lines if line.startswith("quantwatch agent:")] for lines in stderr]
    assert len(agent_lines[0]) == 1
    assert "no quantized layer found" in agent_lines[0][0]
    assert "quantize_model" in agent_lines[0][0]
    assert agent_lines[1:] == [[]] * (len(blocks) - 1)
