"""What the client commands of the ``quantwatch`` command line share: their options, how they reach the collector,
fail with its exit codes and print tables (imports stay cheap: httpx and rich load when a command runs)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from quantwatch.client import CollectorClient, CollectorError, Params

__all__ = [
    "DEFAULT_URL",
    "JsonOption",
    "TimeoutOption",
    "TokenOption",
    "UrlOption",
    "client_for",
    "fail",
    "get_json",
    "print_json",
    "table",
    "usage",
]

UrlOption = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="QUANTWATCH_URL",
        help="Collector base URL.",
        show_default=True,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="QUANTWATCH_TOKEN", help="Bearer token (scope read; ingest for import)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table (for scripts).")]
TimeoutOption = Annotated[
    float, typer.Option("--timeout", min=0.1, help="Seconds to wait for each answer of the collector.")
]
DEFAULT_URL = "http://127.0.0.1:8000"


def fail(error: CollectorError) -> NoReturn:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code=int(error.exit_code))


def usage(message: str) -> NoReturn:
    from quantwatch.client import ExitCode

    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=int(ExitCode.USAGE))


def client_for(url: str, token: str | None, timeout: float) -> CollectorClient:
    from quantwatch.client import CollectorClient

    try:
        return CollectorClient(url, token=token or None, timeout_seconds=timeout)
    except ValueError as exc:
        usage(str(exc))


def get_json(url: str, token: str | None, timeout: float, path: str, params: Params | None = None) -> tuple[str, Any]:
    """GET ``path`` from the collector at ``url``: its base URL and the decoded body; exits on an error answer."""
    from quantwatch.client import CollectorError

    with client_for(url, token, timeout) as client:
        try:
            return client.url, client.get_json(path, params)
        except CollectorError as exc:
            fail(exc)


def print_json(value: object) -> None:
    from quantwatch.client import dumps

    typer.echo(dumps(value))


def _cell(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    typer.echo(title)
    table = Table(show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    # On a terminal fit its width; into a pipe or file never fold cells, so scripts can grep whole names.
    width = None if sys.stdout.isatty() else 1000
    Console(soft_wrap=False, width=width).print(table)
