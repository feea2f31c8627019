"""``quantwatch demo``: the whole system in one process, in under a minute, on a laptop CPU.

A small transformer learns a synthetic task (next token of a seeded Markov chain: no downloads) with a mixed
low-precision recipe made by ``quantize_model``: FP8 for the sensitive layers (attention, output head), NVFP4 for the
MLPs, and plain FP4 with one per-tensor scale — weights, inputs and gradients — for one MLP projection: the
configuration that goes wrong. Its output gradients span more range than one FP4 scale can hold, the small ones
underflow, and the direction of its weight update drifts away from the FP32 reference until it is more than 5% off
(``update_cosine`` below 0.95), while every other layer stays above 0.99.

The agent is attached with a layer shadow for every quantized layer and a full FP32 shadow model trained in lockstep;
it streams to a collector started in this process (SQLite ``./quantwatch-demo.db``) with the shipped alert rules on,
tuned for this recipe (:func:`demo_rules`), and a webhook receiver in this process prints each alert as it arrives
after checking its Standard Webhooks signature.

This module imports torch; the collector (``quantwatch.service``) never does.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn
from torch.nn import functional

import quantwatch.agent as qw
from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model
from quantwatch.protocol import lower_is_worse
from quantwatch.service.alerts.rules import DEFAULT_RULES, Rule

__all__ = [
    "RECIPES",
    "DemoOptions",
    "DemoResult",
    "MarkovTask",
    "TinyTransformer",
    "WebhookReceiver",
    "demo_rules",
    "kept_rules_path",
    "make_recipe",
    "run_demo",
    "verify_webhook",
]

DEFAULT_STEPS = 80
LEARNING_RATE = 6e-3
DEFAULT_DATABASE = Path("quantwatch-demo.db")
RUN_NAME = "demo"
# The layer the demo recipe quantizes to plain FP4 with one scale for the whole tensor.
PER_TENSOR_FP4_LAYER = "blocks.1.mlp.fc2"
# The demo's own rule: the update direction of a layer more than 5% off its FP32 reference, 3 steps in a row.
UPDATE_RULE = "quantwatch_update_direction"
# Standard Webhooks: refuse timestamps further than this from now (replay protection).
WEBHOOK_TOLERANCE_SECONDS = 300
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

VOCAB = 32
SEQUENCE = 32
BATCH = 16
WIDTH = 64
HEADS = 4
BLOCKS = 2

_FP8 = QuantConfig(weight=QuantSpec("fp8_e4m3"), input=QuantSpec("fp8_e4m3"), grad=QuantSpec("fp8_e5m2"))
_NVFP4 = QuantConfig(weight=QuantSpec("nvfp4"), input=QuantSpec("nvfp4"), grad=QuantSpec("fp8_e5m2"))
_FP4_PER_TENSOR = QuantConfig(
    weight=QuantSpec("fp4_e2m1", scaling="tensor"),
    input=QuantSpec("fp4_e2m1", scaling="tensor"),
    grad=QuantSpec("fp4_e2m1", scaling="tensor"),
)

RECIPES: dict[str, str] = {
    "mixed": "FP8 attention and head, NVFP4 MLPs, per-tensor FP4 (gradients too) on blocks.1.mlp.fc2",
    "fp8": "FP8 (E4M3 forward, E5M2 gradients) everywhere",
    "fp4": "NVFP4 everywhere but the FP8 head",
}


# Per recipe, the globs of its FP8 layers and of its FP4 layers: what the demo's alert thresholds are scoped by.
_FORMAT_LAYERS: dict[str, tuple[list[str], list[str]]] = {
    "mixed": (["*.attn.*", "head"], ["*.mlp.*"]),
    "fp8": (["*"], []),
    "fp4": (["head"], ["blocks.*"]),
}
# FP4 quantization itself costs 6-14% of output deviation on this model (NVFP4 weights and inputs): a 5% bound suits FP8
# layers only. The FP4 layers get a bound well above their own normal.
FP4_OUTPUT_THRESHOLD = 0.25


def demo_rules(recipe: str, receiver_url: str, secret: str) -> dict[str, Any]:
    """The rules file the demo's collector starts with: the shipped rules, tuned for ``recipe``, and one receiver.

    The shipped 5% output-deviation rule keeps its name and is scoped to the FP8 layers; FP4 layers get
    :data:`FP4_OUTPUT_THRESHOLD`; and :data:`UPDATE_RULE` watches every layer's update direction (``update_cosine``
    below 0.95, i.e. more than 5% off the FP32 reference, for 3 reported steps; firing until 11 steps in a row are
    back above): the rule the drifting per-tensor FP4 layer breaks. This is how a user tunes the shipped rules to a
    recipe: same names, narrower layers.
    """
    fp8_layers, fp4_layers = _FORMAT_LAYERS[recipe]
    output_rule = next(rule for rule in DEFAULT_RULES if rule.name == "quantwatch_output_deviation")
    rules = [
        output_rule.model_copy(update={"layers": fp8_layers}),
        Rule(
            name=UPDATE_RULE,
            metric="update_cosine",
            op="<",
            threshold=0.95,
            consecutive=3,
            # The drift is noisy step to step: one alert for the episode, not one per dip back above 0.95.
            keep_firing_for=10,
            annotations={
                "summary": "The weight update of layer ${layer} in run ${run} points more than 5% away from FP32",
                "description": "update_cosine was ${value} at step ${step} (< 0.95 for 3 consecutive steps).",
            },
        ),
    ]
    if fp4_layers:
        summary = "FP4 layer ${layer} of run ${run} deviates from its FP32 shadow by more than ${threshold}"
        rules.append(
            output_rule.model_copy(
                update={
                    "name": "demo_fp4_output_deviation",
                    "layers": fp4_layers,
                    "threshold": FP4_OUTPUT_THRESHOLD,
                    "annotations": {**output_rule.annotations, "summary": summary},
                }
            )
        )
    return {
        "default_rules": True,
        "rules": [rule.model_dump(mode="json") for rule in rules],
        "receivers": [{"name": "demo-webhook", "url": receiver_url, "secret": secret}],
    }


def kept_rules_path(database: Path) -> Path:
    """Where the demo leaves its rules (without the receiver, which lives only as long as the demo) next to its
    database, so that ``quantwatch serve --rules`` shows the history under the same rules: served without them, the
    collector would retire the demo's rules and their alerts with them."""
    return database.with_name(f"{database.stem}.rules.yaml")


def make_recipe(name: str) -> Recipe:
    """The demo's quantization recipe ``name`` (one of :data:`RECIPES`); ``ValueError`` names the choices.

    The layers of each format are those :func:`demo_rules` scopes its thresholds by; in ``mixed`` the per-tensor FP4
    layer comes first (the first matching glob wins).
    """
    if name not in _FORMAT_LAYERS:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    fp8_layers, fp4_layers = _FORMAT_LAYERS[name]
    per_tensor = [(PER_TENSOR_FP4_LAYER, _FP4_PER_TENSOR)] if name == "mixed" else []
    return Recipe(rules=[*((glob, _FP8) for glob in fp8_layers), *per_tensor, *((glob, _NVFP4) for glob in fp4_layers)])


# --------------------------------------------------------------------------------------------------- model and task
class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(functional.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = _Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class TinyTransformer(nn.Module):
    """A two-block causal transformer (width 64, 4 heads); its linear layers are what ``quantize_model`` swaps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(SEQUENCE, WIDTH))
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position."""
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


class MarkovTask:
    """Sequences from a fixed random Markov chain over ``VOCAB`` tokens; the model learns its transitions.

    The chain is peaked (a few likely successors per token), so the loss falls quickly from ln(VOCAB) towards the
    chain's entropy: a real learning curve in a few dozen steps. Everything derives from ``seed``.
    """

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(VOCAB, VOCAB, generator=self._generator) * 2.5
        self.transitions = torch.softmax(logits, dim=-1)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``BATCH × SEQUENCE`` token ids; targets are the inputs shifted by one."""
        tokens = torch.empty(BATCH, SEQUENCE + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=self._generator)
        for t in range(SEQUENCE):
            tokens[:, t + 1] = torch.multinomial(self.transitions[tokens[:, t]], 1, generator=self._generator)[:, 0]
        return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------- webhooks
def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float | None = None,
    tolerance_seconds: float = WEBHOOK_TOLERANCE_SECONDS,
) -> bool:
    """Check a Standard Webhooks signature: HMAC-SHA256 over ``id.timestamp.body`` with the ``whsec_`` secret.

    True when any ``v1,`` signature in ``webhook-signature`` matches (compared in constant time) and the timestamp is
    within ``tolerance_seconds`` of ``now``. Header names are matched case-insensitively.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    webhook_id = lower.get("webhook-id")
    timestamp = lower.get("webhook-timestamp")
    signatures = lower.get("webhook-signature")
    if not webhook_id or not timestamp or not signatures or not secret.startswith("whsec_"):
        return False
    try:
        sent_at = int(timestamp)
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent_at) > tolerance_seconds:
        return False
    expected = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    for candidate in signatures.split():
        version, _, encoded = candidate.partition(",")
        if version != "v1":
            continue
        try:
            given = base64.b64decode(encoded, validate=True)
        except ValueError:
            continue
        if hmac.compare_digest(given, expected):
            return True
    return False


@dataclass(frozen=True)
class Notification:
    """One webhook the receiver got: its headers and raw body, whether the signature held, the decoded body."""

    webhook_id: str
    signature_valid: bool
    body: dict[str, Any]
    raw_body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """``firing`` or ``resolved``."""
        return str(self.body.get("status"))

    @property
    def details(self) -> dict[str, Any]:
        """The body's ``quantwatch`` block: rule, run, layer, metric, step, value, threshold."""
        block = self.body.get("quantwatch")
        return block if isinstance(block, dict) else {}


class WebhookReceiver:
    """An HTTP receiver on loopback that verifies each webhook's signature, keeps it and reports it."""

    def __init__(self, on_notification: Callable[[Notification], None] | None = None) -> None:
        self.secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode("ascii")
        self.notifications: list[Notification] = []
        self._lock = threading.Lock()
        self._on_notification = on_notification
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                valid = verify_webhook(receiver.secret, dict(self.headers.items()), body)
                try:
                    decoded = json.loads(body)
                except ValueError:
                    decoded = {}
                notification = Notification(
                    webhook_id=self.headers.get("webhook-id") or "",
                    signature_valid=valid,
                    body=decoded if isinstance(decoded, dict) else {},
                    raw_body=body,
                    headers=dict(self.headers.items()),
                )
                receiver._record(notification)
                self.send_response(204 if valid else 401)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the demo prints each notification itself."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/webhook"
        self._thread = threading.Thread(target=self._server.serve_forever, name="demo-webhooks", daemon=True)

    def _record(self, notification: Notification) -> None:
        with self._lock:
            self.notifications.append(notification)
        if self._on_notification is not None:
            self._on_notification(notification)

    def start(self) -> None:
        """Start answering on :attr:`url`."""
        self._thread.start()

    def stop(self) -> None:
        """Stop and release the port."""
        self._server.shutdown()
        self._server.server_close()


# --------------------------------------------------------------------------------------------------- collector
def _port_to_use(preferred: int) -> int:
    """``preferred`` when it is free on loopback (0: any), else a free one."""
    from quantwatch.service.server import free_port

    if preferred == 0:
        return free_port()
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            return free_port()
    return preferred


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


# --------------------------------------------------------------------------------------------------- the demo
@dataclass(frozen=True)
class DemoOptions:
    """What ``quantwatch demo`` was asked for; validated on construction (``ValueError`` names the option)."""

    steps: int = DEFAULT_STEPS
    recipe: str = "mixed"
    seed: int = 0
    keep_serving: bool = False
    url: str | None = None
    token: str | None = None
    database: Path = DEFAULT_DATABASE
    port: int = 8000

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")


@dataclass
class DemoResult:
    """What a demo run produced, for the summary and for tests."""

    run: str
    url: str
    steps: int
    seconds: float
    points_sent: int
    notifications: list[Notification] = field(default_factory=list)
    webhook_secret: str | None = None
    alerts: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


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
            run = f"{RUN_NAME}-{options.recipe}-seed{options.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            result = _train_and_report(options, console, options.url, run, receiver=None)
            if while_serving is not None:
                while_serving(result)
            return result
        receiver = WebhookReceiver(on_notification=lambda n: _print_notification(console, n))
        receiver.start()
        rules_file = Path(scratch) / "rules.yaml"
        rules = demo_rules(options.recipe, receiver.url, receiver.secret)
        # JSON is YAML: no quoting questions for the secret.
        rules_file.write_text(json.dumps(rules))
        kept = {key: value for key, value in rules.items() if key != "receivers"}
        kept_rules_path(options.database).write_text(json.dumps(kept, indent=2) + "\n")
        port = _port_to_use(options.port)
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
        finally:
            receiver.stop()
    return result


def _print_notification(console: Console, notification: Notification) -> None:
    d = notification.details
    where = d.get("layer") or "(run)"
    what = d.get("metric") or d.get("scalar")
    check = "[green]signature ok[/]" if notification.signature_valid else "[bold red]BAD SIGNATURE[/]"
    colour = "red" if notification.status == "firing" else "green"
    console.print(
        f"[bold {colour}]webhook {notification.status}[/] {d.get('rule')} · {where} · {what} = "
        f"{_format(d.get('value'))} at step {d.get('step')} · {check}"
    )


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
            summary=_summary(http, run),
        )
    _print_summary(console, options, result)
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
            loss = _loss(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            shadow_step = partial(_loss, inputs=inputs, targets=targets)
            monitor.step(step, loss=loss.detach(), shadow_closure=shadow_step)
            progress.update(bar, advance=1, loss=f"{loss.item():.3f}")
    if not monitor.close(timeout_seconds=30):
        console.print("[yellow]the agent could not send everything within 30 s; the rest is spooled[/]")
    return int(monitor.stats().get("sent_points", 0))


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


def _summary(http: httpx.Client, run: str) -> dict[str, Any]:
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


def _print_summary(console: Console, options: DemoOptions, result: DemoResult) -> None:
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
    if not options.keep_serving and options.url is None:
        console.print(
            f"History kept in {options.database}; see it again with [bold]quantwatch serve --database-url "
            f"sqlite:///{options.database} --rules {kept_rules_path(options.database)}[/]",
            soft_wrap=True,  # one line, to copy and paste
        )
