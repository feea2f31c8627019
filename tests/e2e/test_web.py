"""The web view in a real browser (headless Debian Chromium driven by Playwright) against a real collector."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


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


def _open_run(page: Page, collector: Any) -> list[str]:
    """Open the run's view; return the heatmap API URLs the page requested."""
    heatmap_requests: list[str] = []
    page.on("request", lambda r: heatmap_requests.append(r.url) if "/heatmap?" in r.url else None)
    page.goto(f"{collector.url}/#run={quote(collector.run, safe='')}")
    page.wait_for_selector("#heatmap[data-rows]")
    return heatmap_requests


def _hover_cell(page: Page, row: int, column: int) -> dict[str, str | None]:
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
        "text": tooltip.inner_text(),
    }


def test_heatmap_renders_and_hover_matches_the_api(page: Page, collector: Any) -> None:
    requests = _open_run(page, collector)
    assert requests, "the page never asked for a heatmap"
    answer = httpx.get(requests[-1]).json()
    assert answer["layers"] == list(collector.layers)

    # The plot area holds drawn pixels, and more than one colour (the drifting layer stands out).
    canvas = page.locator("#heatmap")
    plot = json.loads(canvas.get_attribute("data-plot") or "{}")
    colours = page.evaluate(
        """(plot) => {
            const c = document.getElementById('heatmap');
            const dpr = window.devicePixelRatio || 1;
            const img = c.getContext('2d').getImageData(plot.x * dpr, plot.y * dpr, plot.w * dpr, plot.h * dpr).data;
            const seen = new Set();
            let opaque = 0;
            for (let i = 0; i < img.length; i += 4) {
                if (img[i + 3] > 0) { opaque++; seen.add((img[i] << 16) | (img[i + 1] << 8) | img[i + 2]); }
            }
            return {opaque, total: img.length / 4, distinct: seen.size};
        }""",
        plot,
    )
    assert colours["opaque"] == colours["total"] > 0
    assert colours["distinct"] > 10

    # Hover the drifting layer in the last column: the tooltip's value is the API's value for that cell.
    row = collector.layers.index(collector.bad_layer)
    column = len(answer["steps"]) - 1
    shown = _hover_cell(page, row, column)
    assert shown["layer"] == collector.bad_layer
    assert shown["step"] == str(answer["steps"][column])
    assert shown["value"] is not None
    assert float(shown["value"]) == answer["values"][row][column]
    assert float(shown["value"]) > 0.05
    assert collector.bad_layer in (shown["text"] or "")

    # A cell that was not measured says so: null is not drawn or reported as zero.
    hole_layer, hole_step = collector.hole
    hole_row = collector.layers.index(hole_layer)
    hole_column = answer["steps"].index(hole_step)
    assert answer["values"][hole_row][hole_column] is None
    shown = _hover_cell(page, hole_row, hole_column)
    assert shown["value"] == "null"
    assert "not measured" in (shown["text"] or "")

    # Clicking a cell selects its layer and step for the series chart.
    page.mouse.down()
    page.mouse.up()
    page.wait_for_function("() => location.hash.includes('step=')")
    assert page.locator("#series-title").inner_text().startswith(hole_layer)

    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#alerts-body tr").first.wait_for()
    _hover_cell(page, row, column)
    page.screenshot(path=str(ARTIFACTS / "web-view.png"), full_page=True)
    assert (ARTIFACTS / "web-view.png").stat().st_size > 10_000


def test_alerts_are_listed_with_links_to_their_step(page: Page, collector: Any) -> None:
    _open_run(page, collector)
    row = page.locator("#alerts-body tr", has_text=collector.bad_layer)
    row.wait_for()
    assert "firing" in row.inner_text()
    assert "output_rel_l2" in row.inner_text()
    # The default rule fires on the third consecutive breaching step.
    fired_at = collector.drift_step + 2
    api_alerts = httpx.get(f"{collector.url}/api/v1/alerts", params={"run": collector.run}).json()
    layer_alerts = [a for a in api_alerts if a["layer"] == collector.bad_layer]
    assert [a["firing"]["step"] for a in layer_alerts] == [fired_at]
    link = row.locator("a")
    assert link.inner_text() == str(fired_at)
    link.click()
    page.wait_for_function(f"() => location.hash.includes('step={fired_at}')")
    page.wait_for_function(
        f"() => document.getElementById('series-title').textContent.startsWith({collector.bad_layer!r})"
    )


def test_unknown_run_shows_the_api_error(page: Page, collector: Any) -> None:
    page.goto(f"{collector.url}/#run=no-such-run")
    banner = page.locator("#banner")
    banner.wait_for(state="visible")
    assert "no-such-run" in banner.inner_text()
    assert "404" in banner.inner_text()


def test_runs_list_links_to_the_run(page: Page, collector: Any) -> None:
    page.goto(f"{collector.url}/")
    link = page.locator(f'#runs-list a[data-run="{collector.run}"]')
    link.wait_for()
    assert f"{len(collector.layers)} layers" in link.inner_text()
    # With no run in the URL the most recent run opens by itself.
    page.wait_for_function("() => location.hash.includes('run=')")
    page.wait_for_selector("#heatmap[data-rows]")


def test_token_prompt_on_a_secured_collector(page: Page, secured_collector: Any) -> None:
    page.goto(f"{secured_collector.url}/")
    page.locator("#token-form").wait_for(state="visible")
    assert "401" in page.locator("#banner").inner_text()
    page.fill("#token-input", secured_collector.read_token)
    page.click("#token-form button")
    page.locator(f'#runs-list a[data-run="{secured_collector.run}"]').wait_for()
    page.wait_for_selector("#heatmap[data-rows]")
    assert page.locator("#banner").is_hidden()


def test_empty_collector_says_how_to_get_runs(page: Page, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}")
    with BackgroundServer(create_app(settings)) as server:
        page.goto(f"{server.url}/")
        empty = page.locator("#runs-empty")
        empty.wait_for(state="visible")
        assert "quantwatch demo" in empty.inner_text()
        assert page.locator("#welcome").is_visible()
        assert page.locator("#banner").is_hidden()
