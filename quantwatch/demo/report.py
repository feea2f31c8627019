"""The demo's summary: what the collector holds about the run, printed as tables with the links to look at."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from rich.console import Console
from rich.table import Table

from quantwatch.demo.options import DemoOptions, DemoResult
from quantwatch.demo.recipes import RECIPES
from quantwatch.demo.webhooks import Notification
from quantwatch.protocol import lower_is_worse

# The metrics whose worst layers the summary lists.
SUMMARY_METRICS = (
    "output_rel_l2",
    "weight_rel_l2",
    "act_rel_l2",
    "grad_rel_l2",
    "underflow_ratio",
    "update_cosine",
    "weight_drift_rel_l2",
)


def print_notification(console: Console, notification: Notification) -> None:
    """One line per webhook the receiver got: rule, layer, value, step, and whether its signature held."""
    d = notification.details
    where = d.get("layer") or "(run)"
    what = d.get("metric") or d.get("scalar")
    check = "[green]signature ok[/]" if notification.signature_valid else "[bold red]BAD SIGNATURE[/]"
    colour = "red" if notification.status == "firing" else "green"
    console.print(
        f"[bold {colour}]webhook {notification.status}[/] {d.get('rule')} · {where} · {what} = "
        f"{_format(d.get('value'))} at step {d.get('step')} · {check}"
    )


def collect_summary(http: httpx.Client, run: str) -> dict[str, Any]:
    """What the collector holds about ``run``: its facts, the worst layers per metric (mean over the run), scalars."""
    path = f"/api/v1/runs/{quote(run, safe='')}"
    summary: dict[str, Any] = {"run": http.get(path).raise_for_status().json(), "worst": {}, "scalars": {}}
    seen = set(summary["run"].get("metrics", []))
    for metric in [m for m in SUMMARY_METRICS if m in seen]:
        heatmap = http.get(f"{path}/heatmap", params={"metric": metric, "max_steps": 1, "agg": "mean"})
        if heatmap.status_code != 200:
            continue
        body = heatmap.json()
        means = []
        for layer, row in zip(body["layers"], body["values"], strict=True):
            finite = [v for v in row if isinstance(v, int | float) and math.isfinite(v)]
            if finite:
                means.append((sum(finite) / len(finite), layer))
        # Worst first: lowest for figures where high is good (cosine, SQNR), highest otherwise.
        means.sort(reverse=not lower_is_worse(metric))
        summary["worst"][metric] = means[:3]
    for scalar in ("loss", "loss_shadow", "agent_overhead_ratio"):
        answer = http.get(f"{path}/series", params={"scalar": scalar})
        if answer.status_code == 200:
            summary["scalars"][scalar] = answer.json()
    return summary


def _last(series: Mapping[str, Any] | None) -> float | None:
    if not series or not series.get("mean"):
        return None
    value = series["mean"][-1]
    return float(value) if isinstance(value, int | float) else None


def _mean(series: Mapping[str, Any] | None) -> float | None:
    values = [v for v in (series or {}).get("mean", []) if isinstance(v, int | float) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _first_firing(alerts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The firing per-layer alert that fired first (the likeliest cause of what followed), if any."""
    candidates = [
        a
        for a in alerts
        if a.get("state") == "firing" and a.get("layer") and a.get("firing") and "metric" in (a.get("labels") or {})
    ]
    return min(candidates, key=lambda a: (int(a["firing"]["step"]), str(a["layer"])), default=None)


def _format(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_summary(console: Console, options: DemoOptions, result: DemoResult) -> None:
    """The tables of the run, its alerts and the links to the web view, the API and the kept history."""
    run_info = result.summary.get("run", {})
    scalars = result.summary.get("scalars", {})
    overview = Table(title=f"quantwatch demo — run {result.run!r}", show_header=False, title_justify="left")
    overview.add_column(style="bold")
    overview.add_column()
    overview.add_row("recipe", f"{options.recipe}: {RECIPES[options.recipe]}")
    overview.add_row("steps", f"{result.steps} in {result.seconds:.1f} s (seed {options.seed})")
    loss, shadow = _last(scalars.get("loss")), _last(scalars.get("loss_shadow"))
    if loss is not None and shadow is not None:
        overview.add_row("final loss", f"{loss:.4f} quantized vs {shadow:.4f} FP32 shadow ({loss / shadow - 1:+.2%})")
    overhead = _mean(scalars.get("agent_overhead_ratio"))
    if overhead is not None:
        overview.add_row("agent overhead", f"{overhead:.1%} of step time (every step sampled, both shadows on)")
    overview.add_row("points", f"{result.points_sent} sent by the agent, {run_info.get('points')} stored")
    console.print(overview)

    worst = Table(title="worst layers per metric (mean over the run)", title_justify="left")
    worst.add_column("metric", overflow="fold")
    worst.add_column("layers, worst first", overflow="fold")
    for metric, ranked in result.summary.get("worst", {}).items():
        worst.add_row(metric, ", ".join(f"{layer} {value:.4g}" for value, layer in ranked))
    console.print(worst)

    alerts = Table(title="alerts", title_justify="left")
    for column in ("rule", "layer", "fired at step", "state", "value"):
        alerts.add_column(column, overflow="fold")
    for alert in sorted(result.alerts, key=lambda a: ((a.get("firing") or {}).get("step", -1), a.get("layer") or "")):
        fired = (alert.get("firing") or {}).get("step")
        alerts.add_row(
            str(alert.get("rule")),
            str(alert.get("layer") or "(run)"),
            str(fired),
            str(alert.get("state")),
            _format(alert.get("value")),
        )
    if not result.alerts:
        alerts.add_row("none", "", "", "", "")
    console.print(alerts)
    if result.actions:
        taken = Table(title="actions taken on the training job", title_justify="left")
        for column in ("after step", "action", "layer", "what changed"):
            taken.add_column(column, overflow="fold")
        for action in result.actions:
            taken.add_row(str(action["step"]), action["action"], action["layer"] or "(run)", action["detail"])
        console.print(taken)
    if result.notifications:
        valid = sum(n.signature_valid for n in result.notifications)
        console.print(f"webhooks received: {len(result.notifications)}, signatures valid: {valid}")
    base = result.url
    console.print(f"web view   [bold]{base}/#run={quote(result.run, safe='')}[/]")
    first_look = _first_firing(result.alerts)
    if first_look is not None:
        # The view opened on the first firing layer at the step its alert fired: where to look first.
        view = urlencode({"run": result.run, "metric": first_look["labels"]["metric"], "layer": first_look["layer"],
                          "step": first_look["firing"]["step"]})  # fmt: skip
        console.print(f"first alert [bold]{base}/#{view}[/]")
    console.print(f"REST API   {base}/api/v1/runs/{quote(result.run, safe='')}   (docs: {base}/docs)")
    with httpx.Client(timeout=5) as http:
        if http.get(f"{base}/metrics").status_code == 200:
            console.print(f"Prometheus {base}/metrics")


def print_stopped(console: Console, url: str, database: Path, port: int) -> None:
    """Say that the demo's collector at ``url`` has stopped, and print the one command that serves its history again
    from any directory: absolute paths and the port it used (the demo runs the shipped rules, the collector's
    default, so its alerts are served as they were)."""
    database = database.resolve()
    command = f"quantwatch serve --database-url sqlite:///{database} --port {port}"
    console.print(f"The demo's collector at {url} has stopped. History kept in {database}.")
    console.print(
        f"See the run again with [bold]{command}[/] and open {url}/#run=demo",
        soft_wrap=True,  # one line, to copy and paste
    )
