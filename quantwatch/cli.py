"""The ``quantwatch`` command line.

Importing this module stays cheap (no httpx, rich tables, torch or database code): each command imports what it
needs when it runs, so ``quantwatch --help`` answers at once.
"""

from __future__ import annotations

import datetime
import enum
import gzip
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from quantwatch import __version__
from quantwatch.advise_cli import advise
from quantwatch.cli_common import DEFAULT_URL, JsonOption, TimeoutOption, TokenOption, UrlOption
from quantwatch.cli_common import client_for as _client
from quantwatch.cli_common import fail as _fail
from quantwatch.cli_common import get_json as _get_json
from quantwatch.cli_common import print_json as _print_json
from quantwatch.cli_common import table as _table
from quantwatch.cli_common import usage as _usage
from quantwatch.service.alerts.cli import app as rules_app
from quantwatch.service.cli import register as register_service

if TYPE_CHECKING:
    pass

# "\b" keeps click from re-wrapping the table.
EXIT_CODES_HELP = """\b
Exit codes of the client commands (runs, alerts, series, advise, export, import, replay):
  0  success
  1  the collector failed (5xx) or answered something that is not the API
  2  bad arguments, or an unreadable input file
  3  collector unreachable (refused, DNS, timeout)
  4  not found (404: run, layer, metric)
  5  authentication failed (401/403: token missing, wrong or under-scoped)
  6  the collector refused the request as invalid (400/413/415/422)
"""

app = typer.Typer(
    help="QuantWatch: watch quantization error while low-precision training runs.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(rules_app, name="rules")
app.command()(advise)


class AlertState(str, enum.Enum):
    """Alert states to filter on."""

    pending = "pending"
    firing = "firing"
    resolved = "resolved"


class ExportFormat(str, enum.Enum):
    """Formats of ``quantwatch export``."""

    csv = "csv"
    parquet = "parquet"


def _step_range(first: object, last: object) -> str | None:
    if first is None or last is None:
        return None
    return f"{first}–{last}"


def _utc(epoch_seconds: object) -> str | None:
    if not isinstance(epoch_seconds, int | float):
        return None
    return datetime.datetime.fromtimestamp(epoch_seconds, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _items(body: Any, key: str) -> list[dict[str, Any]]:
    if isinstance(body, list):
        return [b for b in body if isinstance(b, dict)]
    if isinstance(body, dict) and isinstance(body.get(key), list):
        return [b for b in body[key] if isinstance(b, dict)]
    return []


@app.command()
def version() -> None:
    """Print the installed version."""
    typer.echo(__version__)


@app.command()
def demo(
    steps: Annotated[int, typer.Option("--steps", min=1, help="Training steps.")] = 80,
    recipe: Annotated[
        str, typer.Option("--recipe", help="Quantization recipe: mixed (FP8 + FP4), fp8 or fp4.")
    ] = "mixed",
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the model, the data and so the alerts.")] = 0,
    keep_serving: Annotated[
        bool, typer.Option("--keep-serving", help="Leave the collector and web view up afterwards (Ctrl-C stops).")
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help="Send to this existing collector instead of starting one (its own rules apply; --token needs the "
            "read and ingest scopes).",
        ),
    ] = None,
    token: TokenOption = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port of the demo collector.")] = 8000,
    database: Annotated[
        Path, typer.Option("--database", dir_okay=False, help="SQLite file of the demo collector (recreated).")
    ] = Path("quantwatch-demo.db"),
    remediate: Annotated[
        bool, typer.Option("--remediate", help="Act on the alert: move the failing layer to FP8 and watch it recover.")
    ] = False,
) -> None:
    """Train a small quantized model with the agent attached, watch an alert fire, and show where to look."""
    from quantwatch.client import validate_url

    try:
        from quantwatch.demo import DemoOptions, run_demo
    except ImportError as exc:
        if exc.name != "torch" and "PyTorch" not in str(exc):
            raise
        _usage("the demo trains a model, which needs PyTorch: pip install 'quantwatch[agent]'")

    try:
        options = DemoOptions(
            steps=steps,
            recipe=recipe,
            seed=seed,
            keep_serving=keep_serving,
            url=validate_url(url) if url is not None else None,
            token=token,
            database=database,
            port=port,
            remediate=remediate,
        )
    except ValueError as exc:
        _usage(str(exc))
    from rich.console import Console

    from quantwatch.client import CollectorError

    # Into a pipe or a log, do not wrap at 80 columns: URLs and table rows stay whole.
    try:
        run_demo(options, Console(width=None if sys.stdout.isatty() else 160))
    except CollectorError as exc:  # with --url: a token without the read and ingest scopes, an unreachable collector
        _fail(exc)


@app.command()
def runs(
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """List the runs the collector knows: steps, layers, metrics, firing alerts, last seen."""
    from quantwatch.client import API_PREFIX

    collector, body = _get_json(url, token, timeout, f"{API_PREFIX}/runs")
    if as_json:
        _print_json(body)
        return
    items = _items(body, "runs")
    if not items:
        typer.echo(f"No runs on {collector} yet.")
        return
    _table(
        f"Runs on {collector}",
        ["run", "steps", "layers", "ranks", "points", "metrics", "firing alerts", "last seen (UTC)"],
        [
            [
                run.get("name"),
                _step_range(run.get("first_step"), run.get("last_step")),
                run.get("layer_count"),
                run.get("ranks"),
                run.get("points"),
                len(run.get("metrics") or []),
                run.get("firing_alerts"),
                _utc(run.get("last_seen_at")),
            ]
            for run in items
        ],
    )


@app.command()
def alerts(
    run: Annotated[str | None, typer.Option("--run", help="Only alerts of this run.")] = None,
    state: Annotated[AlertState | None, typer.Option("--state", help="Only alerts in this state.")] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """List alert episodes (rule, run, layer, state, step) from the collector; an unknown --run exits 4."""
    from quantwatch.client import API_PREFIX, CollectorClient

    if run is not None:
        _get_json(url, token, timeout, CollectorClient.run_path(run))  # a run the collector does not know: 404
    _, body = _get_json(
        url, token, timeout, f"{API_PREFIX}/alerts", {"run": run, "state": state.value if state else None}
    )
    if as_json:
        _print_json(body)
        return
    items = _items(body, "alerts")
    if not items:
        typer.echo("No alerts" + (f" in state {state.value}" if state else "") + (f" for run {run}." if run else "."))
        return
    _table(
        "Alerts",
        ["state", "rule", "run", "layer", "metric", "fired at step", "latest step", "value", "severity"],
        [
            [
                a.get("state"),
                a.get("rule"),
                a.get("run"),
                a.get("layer"),
                (a.get("labels") or {}).get("metric"),
                (a.get("firing") or {}).get("step"),
                a.get("latest_step", a.get("step")),
                a.get("value"),
                a.get("severity"),
            ]
            for a in items
        ],
    )


@app.command()
def series(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run name.")],
    metric: Annotated[str | None, typer.Option("--metric", help="Per-layer metric, e.g. output_rel_l2.")] = None,
    layer: Annotated[str | None, typer.Option("--layer", help="Layer name (with --metric).")] = None,
    scalar: Annotated[str | None, typer.Option("--scalar", help="Per-run scalar instead, e.g. loss.")] = None,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Rank (default: the collector's, 0).")] = None,
    start: Annotated[int | None, typer.Option("--start", min=0, help="First step.")] = None,
    end: Annotated[int | None, typer.Option("--end", min=0, help="Last step.")] = None,
    max_points: Annotated[
        int | None, typer.Option("--max-points", min=1, help="Bucket into at most this many min/mean/max points.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """Print one series: a layer's metric (--metric --layer) or a scalar (--scalar), exact or bucketed."""
    from quantwatch.client import CollectorClient

    if scalar is not None and (metric is not None or layer is not None):
        _usage("give either --scalar, or --metric with --layer, not both")
    if scalar is None and (metric is None or layer is None):
        _usage("give --metric and --layer (or --scalar for a per-run scalar such as loss)")
    if start is not None and end is not None and start > end:
        _usage(f"--start ({start}) is after --end ({end})")
    params: dict[str, str | int | None] = {
        "metric": metric,
        "layer": layer,
        "scalar": scalar,
        "rank": rank,
        "start": start,
        "end": end,
        "max_points": max_points,
    }
    _, body = _get_json(url, token, timeout, CollectorClient.run_path(run, "/series"), params)
    if as_json:
        _print_json(body)
        return
    steps = body.get("steps") or [] if isinstance(body, dict) else []
    what = scalar if scalar is not None else f"{metric} of {layer}"
    if not steps:
        typer.echo(f"No points for {what} in run {run}" + (" in that step range." if start or end else "."))
        return
    lows, means, highs = body.get("min") or [], body.get("mean") or [], body.get("max") or []
    if body.get("bucket_steps", 1) == 1:
        _table(f"{run}: {what}", ["step", "value"], [[s, v] for s, v in zip(steps, means, strict=False)])
    else:
        _table(
            f"{run}: {what} (buckets of {body.get('bucket_steps')} steps: min/mean/max)",
            ["step", "min", "mean", "max"],
            [list(row) for row in zip(steps, lows, means, highs, strict=False)],
        )
    if body.get("raw_from_step") is not None:
        typer.echo(
            f"Retention dropped the raw points before step {body['raw_from_step']}: "
            "those buckets come from the rollups (at least 64 steps each)."
        )


@app.command()
def export(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run name.")],
    fmt: Annotated[ExportFormat, typer.Option("--format", help="Output format.")] = ExportFormat.csv,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", dir_okay=False, help="File to write (default: standard output)."),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    timeout: TimeoutOption = 300.0,
) -> None:
    """Export every stored point of a run (exact values) as CSV or Parquet."""
    from quantwatch.client import CollectorError

    if output is None and fmt is ExportFormat.parquet and sys.stdout.isatty():
        _usage("Parquet is binary: give -o FILE or redirect standard output")
    params = {"format": fmt.value}
    with _client(url, token, timeout) as client:
        try:
            if output is None:
                try:
                    client.download(client.run_path(run, "/export"), params, sys.stdout.buffer)
                    sys.stdout.buffer.flush()
                except BrokenPipeError:
                    # `quantwatch export RUN | head`: the reader had enough, which is not a failure. Point stdout
                    # at /dev/null so the interpreter's own flush at exit does not fail on the closed pipe.
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return
            # Write next to the target and rename, so a failed export never leaves a partial file behind.
            directory = output.resolve().parent
            if not directory.is_dir():
                _usage(f"--output: directory {directory} does not exist")
            fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", dir=directory)
            try:
                with os.fdopen(fd, "wb") as tmp:
                    written = client.download(client.run_path(run, "/export"), params, tmp)
                # mkstemp makes the file private (0600); give it the mode a plain open() would have.
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp_name, 0o666 & ~umask)
                Path(tmp_name).replace(output)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        except CollectorError as exc:
            _fail(exc)
    typer.echo(f"Wrote {written} bytes ({fmt.value}) to {output}", err=True)


def _batch_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, line) of a JSON-lines file, plain or gzip-compressed, or ``-`` for standard input."""
    if str(path) == "-":
        yield from enumerate(sys.stdin.buffer, start=1)
        return
    with path.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as stream:
        yield from enumerate(stream, start=1)


@app.command(name="import")
def import_(
    file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE",
            help="JSON-lines file of the agent's file exporter (one ingest batch per line; .gz ok; - for stdin).",
            allow_dash=True,
        ),
    ],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """Send every batch of a JSON-lines file to the collector. Safe to repeat: batches already stored are skipped."""
    from quantwatch.client import CollectorError

    if str(file) != "-" and not file.is_file():
        _usage(f"FILE: {file} is not a readable file")
    sent = _Delivery()
    with _client(url, token, timeout) as client:
        try:
            for number, line in _batch_lines(file):
                text = line.strip()
                if not text:
                    continue
                try:
                    batch = json.loads(text)
                except ValueError as exc:
                    _import_stopped(file, number, f"not valid JSON ({exc})", sent.stored)
                if not isinstance(batch, dict) or not isinstance(batch.get("batch_id"), str):
                    _import_stopped(
                        file, number, "not an ingest batch (a JSON object with a string batch_id)", sent.stored
                    )
                try:
                    answer = client.ingest(text)
                except CollectorError as exc:
                    typer.echo(f"error: {file}:{number}: {exc}", err=True)
                    typer.echo(_resume_hint(sent.stored), err=True)
                    raise typer.Exit(code=int(exc.exit_code)) from exc
                sent.count(answer)
        except OSError as exc:
            _usage(f"FILE: cannot read {file}: {exc}")
    sent.report("Imported", f"into {client.url}", as_json)


@dataclass
class _Delivery:
    """What ``import`` or ``replay`` sent: batches, those the collector stored (and their points), those it had."""

    batches: int = 0
    stored: int = 0
    duplicates: int = 0
    points: int = 0

    def count(self, answer: dict[str, Any]) -> None:
        """Count one ingest answer."""
        self.batches += 1
        if answer.get("duplicate"):
            self.duplicates += 1
        else:
            self.stored += 1
            self.points += int(answer.get("points") or 0)

    def report(self, verb: str, where: str, as_json: bool) -> None:
        """Print the summary ("<verb> N batches <where>: …"), or the counts as JSON."""
        if as_json:
            _print_json(
                {"batches": self.batches, "stored": self.stored, "duplicates": self.duplicates, "points": self.points}
            )
            return
        typer.echo(
            f"{verb} {self.batches} batches {where}: {self.stored} stored ({self.points} points), "
            f"{self.duplicates} already there."
        )


def _resume_hint(stored: int) -> str:
    return (
        f"  {stored} batches before it were stored; re-running the import is safe "
        "(batches already stored are recognised by batch_id)."
    )


def _import_stopped(file: Path, number: int, reason: str, stored: int) -> NoReturn:
    from quantwatch.client import ExitCode

    typer.echo(f"error: {file}:{number}: {reason}", err=True)
    typer.echo(_resume_hint(stored), err=True)
    raise typer.Exit(code=int(ExitCode.USAGE))


@app.command()
def replay(
    spool_dir: Annotated[
        Path,
        typer.Argument(
            metavar="SPOOL_DIR",
            help="A job's spool directory, or a folder above several (every spool below it is replayed).",
        ),
    ],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 30.0,
) -> None:
    """Deliver what a finished job left in its disk spool, oldest first. Each batch is deleted once the collector
    stored it (or already had it), so the replay is safe to repeat or to resume."""
    from quantwatch.client import CollectorError

    if not spool_dir.is_dir():
        _usage(f"SPOOL_DIR: {spool_dir} is not a directory")
    try:
        from quantwatch.agent.spool import DiskSpool, spool_directories
    except ImportError as exc:
        _usage(f"replay reads the agent's spool: {exc}")
    sent = _Delivery()
    with _client(url, token, timeout) as client:
        for directory in spool_directories(spool_dir):
            spool = DiskSpool(directory, max_bytes=1 << 62)  # never appended to here: the cap does not apply
            while (entry := spool.oldest()) is not None:
                batch = entry.batch
                try:
                    answer = client.ingest(batch.body, content_type=batch.content_type, gzipped=batch.gzip)
                except CollectorError as exc:
                    typer.echo(f"error: {entry.path}: {exc}", err=True)
                    typer.echo(
                        f"  {sent.batches} batches before it were delivered and removed from the spool; the rest "
                        "stay. Re-running the replay is safe (the collector recognises batches by batch_id).",
                        err=True,
                    )
                    raise typer.Exit(code=int(exc.exit_code)) from exc
                spool.remove(entry)
                sent.count(answer)
    sent.report("Replayed", f"from {spool_dir} into {client.url}", as_json)


register_service(app)


def main() -> None:
    """Entry point of the ``quantwatch`` console script."""
    app()


if __name__ == "__main__":
    main()
