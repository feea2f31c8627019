"""The demo's run: a collector and a webhook receiver in this process (unless ``--url``), training with the agent
attached, then the summary."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import quantwatch.agent as qw
from quantwatch.demo.model import BATCH, SEQUENCE, MarkovTask, TinyTransformer, next_token_loss
from quantwatch.demo.options import DemoOptions, DemoResult
from quantwatch.demo.recipes import UPDATE_RULE, make_recipe, receiver_rules
from quantwatch.demo.report import collect_summary, print_notification, print_stopped, print_summary
from quantwatch.demo.webhooks import WebhookReceiver
from quantwatch.kernels import quantize_model

LEARNING_RATE = 6e-3
RUN_NAME = "demo"


PORTS_TRIED = 100
"""How many ports from the one asked for the demo tries, one after the other, before it takes any free one."""


def next_free_port(preferred: int) -> int:
    """``preferred`` when it is free on loopback, else the next free one above it (0: any free port)."""
    from quantwatch.service.server import free_port

    if preferred == 0:
        return free_port()
    for port in range(preferred, min(preferred + PORTS_TRIED, 65536)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


DEMO_SCOPES = ("read", "ingest")
"""What the demo's token needs on an existing collector: ingest for the agent, read for the summary."""


def check_scopes(url: str, token: str | None) -> None:
    """Before any training: ask the collector at ``url`` whether ``token`` may read and ingest.

    Raises :class:`~quantwatch.client.AuthError` (exit 5) naming the missing scope, or
    :class:`~quantwatch.client.UnreachableError` (exit 3). The ingest probe posts an empty body: the collector checks
    the token before the body, so a token with the scope gets a 4xx about the body and nothing is stored.
    """
    from quantwatch.client import AuthError, UnreachableError

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            answers = {
                "read": http.get("/api/v1/runs"),
                "ingest": http.post("/api/v1/ingest", content=b"", headers={"Content-Type": "application/json"}),
            }
    except httpx.TransportError as exc:
        raise UnreachableError(f"cannot reach the collector at {url}: {exc}") from exc
    refused = {scope: answer for scope, answer in answers.items() if answer.status_code in (401, 403)}
    if not refused:
        return
    needs = f"the demo needs a token with the {' and '.join(DEMO_SCOPES)} scopes (--token or QUANTWATCH_TOKEN)"
    reasons = "; ".join(f"{scope}: {answer.status_code} {_problem_detail(answer)}" for scope, answer in refused.items())
    raise AuthError(
        f"{needs}; the collector at {url} refused {reasons}", status=next(iter(refused.values())).status_code
    )


def _problem_detail(answer: httpx.Response) -> str:
    try:
        problem = answer.json()
    except ValueError:
        return answer.reason_phrase
    return str(problem.get("detail") or problem.get("title")) if isinstance(problem, dict) else answer.reason_phrase


@contextmanager
def _local_collector(database: Path, rules_file: Path, port: int) -> Iterator[str]:
    """A collector (uvicorn in a thread) on loopback over a fresh SQLite file; yields its base URL."""
    from quantwatch.service import Settings, create_app
    from quantwatch.service.server import BackgroundServer

    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    settings = Settings(database_url=f"sqlite:///{database}", rules_file=rules_file, port=port)
    with BackgroundServer(create_app(settings), port=port) as server:
        yield server.url


def run_demo(
    options: DemoOptions,
    console: Console | None = None,
    *,
    while_serving: Callable[[DemoResult], None] | None = None,
) -> DemoResult:
    """Run the demo: collector and receiver (unless ``options.url``), training with the agent, then the summary.

    ``while_serving(result)`` runs after the summary while the local collector is still up (tests query it there);
    with ``options.keep_serving`` the collector then stays up until Ctrl-C.
    """
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="quantwatch-demo-") as scratch:
        if options.url is not None:
            check_scopes(options.url, options.token)
            run = f"{RUN_NAME}-{options.recipe}-seed{options.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            result = _train_and_report(options, console, options.url, run, receiver=None)
            if while_serving is not None:
                while_serving(result)
            return result
        receiver = WebhookReceiver(on_notification=lambda n: print_notification(console, n))
        receiver.start()
        rules_file = Path(scratch) / "rules.yaml"
        # JSON is YAML: no quoting questions for the secret.
        rules_file.write_text(json.dumps(receiver_rules(receiver.url, receiver.secret)))
        port = next_free_port(options.port)
        if port != options.port and options.port != 0:
            console.print(f"[yellow]port {options.port} is busy; the demo collector uses {port}[/]")
        try:
            with _local_collector(options.database, rules_file, port) as url:
                result = _train_and_report(options, console, url, RUN_NAME, receiver=receiver)
                if while_serving is not None:
                    while_serving(result)
                if options.keep_serving:
                    console.print(f"Collector and web view stay up at [bold]{url}/[/] — Ctrl-C to stop.")
                    try:
                        while True:
                            time.sleep(3600)
                    except KeyboardInterrupt:
                        console.print("stopped")
            print_stopped(console, url, options.database, port)
        finally:
            receiver.stop()
    return result


def _train_and_report(
    options: DemoOptions, console: Console, url: str, run: str, *, receiver: WebhookReceiver | None
) -> DemoResult:
    threads = torch.get_num_threads()
    # A model this small spends its time in per-operation overhead: one thread is faster than a pool and keeps the
    # arithmetic, and so the alerts, identical from run to run.
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        points = _train(options, console, url, run)
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    headers = {"Authorization": f"Bearer {options.token}"} if options.token else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        if receiver is not None:
            _await_deliveries(http, run, receiver)
        result = DemoResult(
            run=run,
            url=url,
            steps=options.steps,
            seconds=seconds,
            points_sent=points,
            notifications=list(receiver.notifications) if receiver is not None else [],
            webhook_secret=receiver.secret if receiver is not None else None,
            alerts=http.get("/api/v1/alerts", params={"run": run}).raise_for_status().json(),
            summary=collect_summary(http, run),
            actions=http.get("/api/v1/actions", params={"run": run}).raise_for_status().json(),
        )
    print_summary(console, options, result)
    return result


def _train(options: DemoOptions, console: Console, url: str, run: str) -> int:
    torch.manual_seed(options.seed)
    task = MarkovTask(options.seed)
    model = quantize_model(TinyTransformer(), make_recipe(options.recipe))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    monitor = qw.attach(
        model,
        run=run,
        url=url,
        token=options.token,
        every=1,
        shadow="model",
        shadow_optimizer=lambda params: torch.optim.AdamW(params, lr=LEARNING_RATE),
        tokens_per_step=BATCH * SEQUENCE,
        flush_interval_seconds=0.5,
    )
    if options.remediate:
        monitor.on_alert(remediate)
    columns = (
        TextColumn("[bold]training[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("train", total=options.steps, loss="—")
        for step in range(options.steps):
            inputs, targets = task.batch()
            loss = next_token_loss(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            shadow_step = partial(next_token_loss, inputs=inputs, targets=targets)
            monitor.step(step, loss=loss.detach(), shadow_closure=shadow_step)
            if options.remediate:
                # Each step's answer is in before the next step: the alert is acted on at the same step every run.
                monitor.flush()
            progress.update(bar, advance=1, loss=f"{loss.item():.3f}")
    if not monitor.close(timeout_seconds=30).delivered:
        console.print("[yellow]the agent could not send everything within 30 s; the rest is spooled[/]")
    return int(monitor.stats().get("sent_points", 0))


def remediate(alert: qw.Alert) -> None:
    """The demo's ``on_alert`` callback: a layer whose update direction drifts goes to FP8 (E4M3 forward, E5M2
    gradients) from the next step on."""
    if alert.rule == UPDATE_RULE and alert.layer:
        qw.actions.keep_high_precision([alert.layer], format="fp8")


def _await_deliveries(http: httpx.Client, run: str, receiver: WebhookReceiver, timeout_seconds: float = 20) -> None:
    """Wait until the collector has no pending webhook for this run and the receiver got each delivered one."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        deliveries = http.get("/api/v1/deliveries").raise_for_status().json()
        pending = [d for d in deliveries if d.get("status") == "pending"]
        delivered = {d.get("webhook_id") for d in deliveries if d.get("status") == "delivered"}
        received = {n.webhook_id for n in receiver.notifications}
        if not pending and delivered <= received:
            return
        time.sleep(0.1)
