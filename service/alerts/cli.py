"""``quantwatch rules …``: offline checks of alert rules files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantwatch.service.alerts.rules import RulesFileError, load_rules_file

app = typer.Typer(help="Alert rules files.", no_args_is_help=True)


@app.command("check")
def check(path: Annotated[Path, typer.Argument(help="YAML rules file to validate.")]) -> None:
    """Validate a rules file; print each problem as FILE:LINE: field: message and exit 1, or summarise it."""
    try:
        rules_file = load_rules_file(str(path))
    except OSError as exc:
        typer.echo(f"{path}: cannot read: {exc.strerror or exc}", err=True)
        raise typer.Exit(code=2) from None
    except RulesFileError as exc:
        typer.echo(exc.format(), err=True)
        raise typer.Exit(code=1) from None
    effective = rules_file.effective_rules()
    enabled = sum(rule.enabled for rule in effective)
    typer.echo(
        f"{path}: OK — {len(rules_file.rules)} rule(s) in the file, {enabled} enabled in effect "
        f"(defaults {'on' if rules_file.default_rules else 'off'}), {len(rules_file.receivers)} receiver(s)"
    )
    for rule in effective:
        typer.echo(f"  {rule.describe()}")
    for rule in effective:
        for warning in rule.warnings():
            typer.echo(f"{path}: warning: {warning}", err=True)
