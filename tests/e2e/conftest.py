"""Fixtures of the end-to-end tests: a real collector on loopback (uvicorn in a thread, SQLite in a temp dir) holding
a short run, the Debian binaries the tests run (a failure, never a skip, when missing), and Debian's Chromium with a
page for the web view's tests."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer

RUN = "e2e/short-run"
LAYERS = [f"blocks.{b}.{part}" for b in range(3) for part in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
STEPS = 40
BAD_LAYER = "blocks.1.mlp.fc1"  # drifts past 5% output deviation from step DRIFT_STEP on
DRIFT_STEP = 25
HOLE = ("blocks.0.attn.proj", 7)  # one point not measured (null)


def output_rel_l2(layer_index: int, step: int) -> float | None:
    """The seeded figures: small, smooth, one layer breaching the 5% threshold late in the run."""
    layer = LAYERS[layer_index]
    if (layer, step) == HOLE:
        return None
    value = 0.004 * (1 + layer_index % 4) * (1 + 0.15 * math.sin(step / 5 + layer_index))
    if layer == BAD_LAYER and step >= DRIFT_STEP:
        value = 0.06 + 0.004 * (step - DRIFT_STEP)
    return round(value, 6)


def batches() -> list[dict[str, Any]]:
    """The run as ingest batches of the wire contract (JSON form), 10 steps per batch."""
    out = []
    for first in range(0, STEPS, 10):
        steps = []
        for step in range(first, first + 10):
            loss = 3.0 * math.exp(-step / 15) + 0.4
            steps.append(
                {
                    "step": step,
                    "time": 1764467200.0 + step,
                    "metrics": {
                        "output_rel_l2": [output_rel_l2(i, step) for i in range(len(LAYERS))],
                        "underflow_ratio": [0.001 * (i % 3) for i in range(len(LAYERS))],
                    },
                    "scalars": {"loss": loss * (1.08 if step >= DRIFT_STEP else 1.0), "loss_shadow": loss},
                }
            )
        out.append({"run": RUN, "rank": 0, "batch_id": f"e2e-{first}", "layers": LAYERS, "steps": steps})
    return out


@dataclass
class Collector:
    """A running collector holding the short run, and what the run holds (tests compare against it)."""

    url: str
    database_path: Path
    run: str = RUN
    layers: tuple[str, ...] = tuple(LAYERS)
    steps: int = STEPS
    bad_layer: str = BAD_LAYER
    drift_step: int = DRIFT_STEP
    hole: tuple[str, int] = HOLE
    read_token: str | None = None
    ingest_token: str | None = None


READ_TOKEN = "e2e-read-token"
INGEST_TOKEN = "e2e-ingest-token"


@pytest.fixture(scope="session")
def secured_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """A collector that needs bearer tokens: ``READ_TOKEN`` (scope read), ``INGEST_TOKEN`` (scope ingest)."""
    database_path = tmp_path_factory.mktemp("secured") / "quantwatch.db"
    settings = Settings(
        database_url=f"sqlite:///{database_path}", tokens={READ_TOKEN: ["read"], INGEST_TOKEN: ["ingest"]}
    )
    with BackgroundServer(create_app(settings)) as server:
        url = server.url
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {INGEST_TOKEN}"}) as http:
            for batch in batches():
                http.post("/api/v1/ingest", json=batch).raise_for_status()
        yield Collector(url=url, database_path=database_path, read_token=READ_TOKEN, ingest_token=INGEST_TOKEN)


@pytest.fixture(scope="session")
def short_run() -> list[dict[str, Any]]:
    """The short run's ingest batches, for a test that needs a collector of its own holding it."""
    return batches()


@pytest.fixture(scope="session")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """A collector on loopback with the short run ingested."""
    database_path = tmp_path_factory.mktemp("collector") / "quantwatch.db"
    with BackgroundServer(create_app(Settings(database_url=f"sqlite:///{database_path}"))) as server:
        url = server.url
        with httpx.Client(base_url=url, timeout=30) as http:
            for batch in batches():
                response = http.post("/api/v1/ingest", json=batch)
                response.raise_for_status()
        yield Collector(url=url, database_path=database_path)


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """Path of the prometheus server binary."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed: .ci/run installs the Debian package prometheus")
    return path


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium; Playwright never downloads a browser here."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page that fails the test on any script error."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], f"script errors in the page: {errors}"


def hover_cell(page: Page, row: int, column: int) -> dict[str, str | None]:
    """Move the mouse over a heatmap cell; what its tooltip says (layer, step, value, the rank when all are shown)."""
    canvas = page.locator("#heatmap")
    box = canvas.bounding_box()
    assert box is not None
    plot = json.loads(canvas.get_attribute("data-plot") or "{}")
    rows = int(canvas.get_attribute("data-rows") or 0)
    columns = int(canvas.get_attribute("data-cols") or 0)
    x = box["x"] + plot["x"] + (column + 0.5) * plot["w"] / columns
    y = box["y"] + plot["y"] + (row + 0.5) * plot["h"] / rows
    page.mouse.move(x, y)
    tooltip = page.locator("#heatmap-tooltip")
    tooltip.wait_for(state="visible")
    return {
        "layer": tooltip.get_attribute("data-layer"),
        "step": tooltip.get_attribute("data-step"),
        "value": tooltip.get_attribute("data-value"),
        "rank": tooltip.get_attribute("data-rank"),
        "text": tooltip.inner_text(),
    }
