"""The ``quantwatch`` command line."""

from __future__ import annotations

import typer

from quantwatch import __version__
from quantwatch.service.alerts.cli import app as rules_app
from quantwatch.service.cli import register as register_service

app = typer.Typer(help="QuantWatch: watch quantization error while low-precision training runs.", no_args_is_help=True)
app.add_typer(rules_app, name="rules")


@app.command()
def version() -> None:
    """Print the installed version."""
    typer.echo(__version__)


@app.command()
def demo() -> None:
    """Train a small quantized model with the agent attached and show where the error goes."""
    typer.echo("quantwatch demo is not built yet (issue 7).", err=True)
    raise typer.Exit(code=1)


register_service(app)


def main() -> None:
    """Entry point of the ``quantwatch`` console script."""
    app()


if __name__ == "__main__":
    main()
