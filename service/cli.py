"""``quantwatch serve``, ``quantwatch db upgrade`` and ``quantwatch db retention`` (mounted into the top-level
``quantwatch`` command)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from quantwatch.service.alerts.rules import RulesFileError
from quantwatch.service.core.config import Settings

db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)

#: Exit status of ``quantwatch serve`` and ``quantwatch db upgrade`` when they cannot start (one line on stderr says
#: why): 2 for a bad option, setting, rules or token file; 3 when the database cannot be opened or migrated.
EXIT_USAGE = 2
EXIT_DATABASE = 3


def _settings(**overrides: Any) -> Settings:
    """Settings from the given options (None = not given) over the environment over the defaults."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            typer.echo(f"error: {field}: {err['msg']}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    except OSError as exc:  # the token file, read while the settings validate
        typer.echo(f"error: cannot read {exc.filename or 'a settings file'}: {exc.strerror or exc}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None


def _database_failed(settings: Settings, action: str, exc: Exception) -> typer.Exit:
    """Say in one line why the database cannot be used (disk full, read-only, locked, unreachable)."""
    from sqlalchemy.engine import make_url

    from quantwatch.service.core.db import describe_database_error

    problem = describe_database_error(exc)
    why = problem.detail if problem is not None else f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    where = make_url(settings.database_url).render_as_string(hide_password=True)
    typer.echo(f"error: cannot {action} the database at {where}: {why}", err=True)
    return typer.Exit(code=EXIT_DATABASE)


#: The settings ``serve`` has an option for; every other one is set by its environment variable only.
_SERVE_OPTIONS = ("host", "port", "database_url", "rules_file", "token_file", "insecure", "fold_chunks")


def _env_var(field: str) -> str:
    return f"{Settings.model_config.get('env_prefix', '')}{field}".upper()


def _default(field: str) -> str:
    info = Settings.model_fields[field]
    value = info.get_default(call_default_factory=True)
    return "none" if value in (None, {}) else str(value).lower() if isinstance(value, bool) else str(value)


def _setting_help(field: str) -> str:
    """An option's help from its setting: description, environment variable and default, as the client commands show
    theirs."""
    return f"{Settings.model_fields[field].description}  [env var: {_env_var(field)}; default: {_default(field)}]"


def _environment_help() -> str:
    """The settings without an option, one ``NAME=DEFAULT  meaning`` line each."""
    lines = [
        f"  {_env_var(field)}={_default(field)}  {info.description}"
        for field, info in Settings.model_fields.items()
        if field not in _SERVE_OPTIONS
    ]
    # "\b" keeps click from re-wrapping the lines.
    return "\b\nMore settings, from the environment only (an option wins over its variable):\n" + "\n".join(lines)


def serve(
    host: Annotated[str | None, typer.Option(help=_setting_help("host"))] = None,
    port: Annotated[int | None, typer.Option(help=_setting_help("port"))] = None,
    database_url: Annotated[str | None, typer.Option(help=_setting_help("database_url"))] = None,
    rules: Annotated[Path | None, typer.Option(help=_setting_help("rules_file"))] = None,
    token_file: Annotated[Path | None, typer.Option(help=_setting_help("token_file"))] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help=_setting_help("insecure"))] = False,
    fold_chunks: Annotated[
        bool | None, typer.Option("--fold-chunks/--no-fold-chunks", help=_setting_help("fold_chunks"))
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the collector on uvicorn (upgrades the database schema first).

    Exits 2 for a bad option, setting, or a missing or invalid --rules or --token-file, and 3 when the database
    cannot be opened or migrated; one line on stderr names the cause (disk full, read-only, locked, unreachable)."""
    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from quantwatch.service.app import create_app

    settings = _settings(
        host=host,
        port=port,
        database_url=database_url,
        rules_file=rules,
        token_file=token_file,
        insecure=True if insecure else None,
        fold_chunks=fold_chunks,
    )
    if settings.rules_file is not None and not settings.rules_file.is_file():
        typer.echo(f"error: --rules: {settings.rules_file} is not a readable file", err=True)
        raise typer.Exit(code=EXIT_USAGE)
    try:
        app = create_app(settings)
    except RulesFileError as exc:
        typer.echo(f"error: invalid rules file:\n{exc.format()}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    except OSError as exc:
        typer.echo(f"error: cannot read {exc.filename or 'a file'}: {exc.strerror or exc}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    except SQLAlchemyError as exc:
        raise _database_failed(settings, "open or migrate", exc) from None
    # What exists now (libraries, routes, the ORM's metadata: ~135k objects) lives as long as the process. Frozen, a
    # full garbage collection no longer walks it: ~50 ms each time otherwise, a pause that lands on whichever request
    # is being served, /metrics included (BENCHMARKS.md, issue 6).
    gc.collect()
    gc.freeze()
    # uvicorn's http and loop "auto" serve with httptools and uvloop, which the collector's install brings.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=log_level == "debug")


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[str | None, typer.Option(help="sqlite:///… or postgresql+psycopg://…")] = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Apply the schema migrations to the database (exit codes as ``serve``)."""
    from sqlalchemy.exc import SQLAlchemyError

    from quantwatch.service.core.db import make_engine, upgrade

    settings = _settings(database_url=database_url, auto_upgrade=False)
    engine = make_engine(settings)
    try:
        upgrade(engine, revision)
    except SQLAlchemyError as exc:
        raise _database_failed(settings, "migrate", exc) from None
    finally:
        engine.dispose()
    typer.echo(f"database at {engine.url.render_as_string(hide_password=True)} is at {revision}")


@db_app.command("retention")
def db_retention(
    database_url: Annotated[str | None, typer.Option(help="sqlite:///… or postgresql+psycopg://…")] = None,
    steps: Annotated[int | None, typer.Option(help=_setting_help("retention_steps"))] = None,
    age: Annotated[str | None, typer.Option(help=_setting_help("retention_age"))] = None,
) -> None:
    """Apply the retention policy now: drop the raw points it makes due, their rollups kept, until none is left
    (what the collector's sweep does in the background; README Retention). Exit codes as ``serve``; 2 too when
    no policy is set."""
    import time

    from sqlalchemy.exc import SQLAlchemyError

    from quantwatch.service.core.db import make_engine, make_sessionmaker
    from quantwatch.service.store import RetentionPass, RetentionPolicy, Store

    settings = _settings(database_url=database_url, retention_steps=steps, retention_age=age, auto_upgrade=False)
    policy = RetentionPolicy(settings.retention_steps, settings.retention_age)
    if not policy.enabled:
        typer.echo("error: retention is off: give --steps or --age (or set their variables)", err=True)
        raise typer.Exit(code=EXIT_USAGE)
    engine = make_engine(settings)
    total = RetentionPass()
    try:
        store = Store(engine, make_sessionmaker(engine))
        while (done := store.sweep_retention(policy, time.time())).ranks:
            total += done
    except SQLAlchemyError as exc:
        raise _database_failed(settings, "apply retention to", exc) from None
    finally:
        engine.dispose()
    typer.echo(f"retention dropped {total.points} raw points ({total.rows} rows) in {total.ranks} transactions")


def register(app: typer.Typer) -> None:
    """Mount ``serve`` and the ``db`` group on the top-level command."""
    app.command("serve", epilog=_environment_help())(serve)
    app.add_typer(db_app, name="db")
