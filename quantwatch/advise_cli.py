"""``quantwatch advise RUN``: the collector's advice from the what-if statistics, as a table, JSON, YAML or Python."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer

from quantwatch.cli_common import DEFAULT_URL, TimeoutOption, TokenOption, UrlOption, get_json, print_json, table, usage

__all__ = ["AdviceFormat", "advise"]


class AdviceFormat(str, enum.Enum):
    """Formats of ``quantwatch advise``."""

    table = "table"
    json = "json"
    yaml = "yaml"
    python = "python"


def _choice(kind: Any) -> str:
    if not isinstance(kind, dict):
        return "high precision"
    return f"{kind.get('candidate')} ({kind.get('rel_l2', float('nan')):.3g})"


def advise(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run name.")],
    budget: Annotated[
        str, typer.Option("--budget", help="Bound on each tensor kind's rel_l2: 0.05, or weight=0.02,grad=0.1.")
    ] = "0.05",
    window: Annotated[int, typer.Option("--window", min=1, help="The latest what-if steps to look at.")] = 5,
    rank: Annotated[int, typer.Option("--rank", min=0, help="Rank whose what-if statistics to read.")] = 0,
    fmt: Annotated[AdviceFormat, typer.Option("--format", help="table, json (the API's answer), yaml or python.")] = (
        AdviceFormat.table
    ),
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    timeout: TimeoutOption = 30.0,
) -> None:
    """Per layer the cheapest format (fewest bits) whose rel_l2 stayed within --budget over the latest what-if steps,
    and the recipe: --format python builds a quantwatch.kernels.Recipe and torchao's module_filter_fn."""
    from quantwatch.client import CollectorClient
    from quantwatch.service.whatif.advice import parse_budget

    try:
        parse_budget(budget)
    except ValueError as exc:
        usage(f"--budget: {exc}")
    params: dict[str, str | int | None] = {"budget": budget, "window": window, "rank": rank}
    _, body = get_json(url, token, timeout, CollectorClient.run_path(run, "/advice"), params)
    recipe = body.get("recipe") if isinstance(body, dict) else None
    if fmt is AdviceFormat.json:
        print_json(body)
        return
    if fmt is not AdviceFormat.table:
        typer.echo((recipe or {}).get(fmt.value, ""), nl=False)
        return
    layers = body.get("layers") or [] if isinstance(body, dict) else []
    if not layers:
        typer.echo(f"No what-if statistics for run {run} (attach(whatif_every=N) sends them; 0 turns them off).")
        return
    steps = body.get("steps") or []
    table(
        f"{run}: cheapest formats within rel_l2 {budget} over what-if steps {steps[0]}–{steps[-1]}",
        ["layer", "weight", "input", "grad", "high precision"],
        [
            [
                a.get("layer"),
                *(_choice((a.get("kinds") or {}).get(kind, {})) for kind in ("weight", "input", "grad")),
                "yes" if a.get("high_precision") else "",
            ]
            for a in layers
        ],
    )
