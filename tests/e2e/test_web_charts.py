"""The layer chart's marks in a real browser (headless Debian Chromium driven by Playwright) against a real
collector: estimated points and the agent's actions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from playwright.sync_api import Page

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer


def _hover_step(page: Page, step: int) -> None:
    """Move the mouse over ``step`` of the layer chart (#series), near its top."""
    point = page.evaluate(
        """(step) => {
            const c = document.getElementById('series');
            const { plot, xmin, xmax } = c._chart;
            const box = c.getBoundingClientRect();
            return [box.left + plot.x + ((step - xmin) / (xmax - xmin)) * plot.w, box.top + plot.y + 5];
        }""",
        step,
    )
    page.mouse.move(point[0], point[1])


def test_estimated_points_are_marked_in_the_layer_chart(page: Page, tmp_path: Path) -> None:
    """Values the agent estimated from a subset of rows read "≈" in the chart's tooltip, and the chart says how many."""
    run, estimated = "e2e/estimated", {3, 4}
    batch = {
        "run": run,
        "batch_id": "estimated-1",
        "layers": ["a", "b"],
        "steps": [
            {"step": step, "metrics": {"output_rel_l2": [0.01 * step, 0.02]}}
            | ({"estimated": ["output_rel_l2"]} if step in estimated else {})
            for step in range(8)
        ],
    }
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'estimated.db'}")
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/api/v1/ingest", json=batch).raise_for_status()
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=output_rel_l2&layer=a")
        note = page.locator("#series-note")
        note.wait_for(state="visible")
        assert note.inner_text().startswith("≈ 2 of 8 points estimated")
        assert json.loads(page.locator("#series").get_attribute("data-estimated") or "[]") == [3, 4]

        def hover(step: int) -> str:
            _hover_step(page, step)
            tooltip = page.locator("#series-tooltip")
            tooltip.wait_for(state="visible")
            page.wait_for_function(
                "(step) => document.getElementById('series-tooltip').innerText.includes('step ' + step)", arg=step
            )
            return tooltip.inner_text()

        assert "≈" in hover(3)
        assert "≈" not in hover(6)


def test_the_agents_actions_are_annotations_on_the_charts(page: Page, tmp_path: Path) -> None:
    """An action the agent took is a labelled line on the loss chart and on its layer's chart (not on another's),
    and hovering its step says what changed."""
    run = "e2e/actions"
    keep = {
        "step": 4,
        "action": "keep_high_precision",
        "layer": "a",
        "detail": "weight fp4_e2m1:tensor → fp8_e4m3:tensor",
    }
    batch = {
        "run": run,
        "batch_id": "actions-1",
        "layers": ["a", "b"],
        "steps": [
            {"step": s, "metrics": {"update_cosine": [0.9, 0.99]}, "scalars": {"loss": 2.0 - 0.1 * s}} for s in range(8)
        ],
        "actions": [keep, {"step": 6, "action": "stop_training"}],
    }
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'actions.db'}")
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/api/v1/ingest", json=batch).raise_for_status()

        def annotations(canvas: str) -> list[dict[str, Any]]:
            page.wait_for_function(f"() => (document.getElementById('{canvas}').dataset.annotations || '[]') !== '[]'")
            return json.loads(page.locator(f"#{canvas}").get_attribute("data-annotations") or "[]")

        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=update_cosine&layer=a")
        expected = [{"step": 4, "label": "keep_high_precision a"}, {"step": 6, "label": "stop_training"}]
        assert annotations("series") == expected
        assert annotations("loss") == expected
        _hover_step(page, 4)
        page.wait_for_function("() => document.getElementById('series-tooltip').innerText.includes('▲')")
        assert (
            "▲ keep_high_precision a: weight fp4_e2m1:tensor → fp8_e4m3:tensor"
            in page.locator("#series-tooltip").inner_text()
        )
        # Layer b's chart, once drawn for b (its series answered), has the run-wide action only: a's is not b's.
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=update_cosine&layer=b")
        page.wait_for_function("() => document.getElementById('series')._chart.spec.lines[0].mean[0] > 0.95")
        assert annotations("series") == [{"step": 6, "label": "stop_training"}]
