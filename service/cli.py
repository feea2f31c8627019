"""``quantwatch serve`` and ``quantwatch db upgrade`` (mounted into the top-level ``quantwatch`` command)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from quantwatch.service.alerts.rules import RulesFileError
from quantwatch.service.core.config import Settings

db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)


def _settings(**overrides: Any) -> Settings:
    """Settings from the given options (None = not given) over the environment over the defaults."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            typer.echo(f"error: {field}: {err['msg']}", err=True)
        raise typer.Exit(code=2) from None


def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000).")] = None,
    database_url: Annotated[str | None, typer.Option(help="sqlite:///… or postgresql+psycopg://…")] = None,
    rules: Annotated[Path | None, typer.Option(help="YAML file of alert rules.")] = None,
    token_file: Annotated[Path | None, typer.Option(help="File of 'TOKEN SCOPE[,SCOPE…]' lines.")] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Allow listening beyond loopback without tokens.")
    ] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the collector on uvicorn (upgrades the database schema first)."""
    import uvicorn

    from quantwatch.service.app import create_app

    settings = _settings(
        host=host,
        port=port,
        database_url=database_url,
        rules_file=rules,
        token_file=token_file,
        insecure=True if insecure else None,
    )
    try:
        app = create_app(settings)
    except RulesFileError as exc:
        typer.echo(f"error: invalid rules file:\n{exc.format()}", err=True)
        raise typer.Exit(code=2) from None
    # What exists now (libraries, routes, the ORM's metadata: ~135k objects) lives as long as the process. Frozen, a
    # full garbage collection no longer walks it: ~50 ms each time otherwise, a pause that lands on whichever request
    # is being served, /metrics included (BENCHMARKS.md, issue 6).
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=log_level == "debug")


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[str | None, typer.Option(help="sqlite:///… or postgresql+psycopg://…")] = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Apply the schema migrations to the database."""
    from quantwatch.service.core.db import make_engine, upgrade

    settings = _settings(database_url=database_url, auto_upgrade=False)
    engine = make_engine(settings)
    upgrade(engine, revision)
    engine.dispose()
    typer.echo(f"database at {engine.url.render_as_string(hide_password=True)} is at {revision}")


def register(app: typer.Typer) -> None:
    """Mount ``serve`` and the ``db`` group on the top-level command."""
    app.command("serve")(serve)
    app.add_typer(db_app, name="db")
