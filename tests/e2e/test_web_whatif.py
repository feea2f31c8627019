"""The web view's what-if table in a real browser against a real collector: the selected layer's candidates, as the
API answers them."""

from __future__ import annotations

from pathlib import Path

import httpx
from playwright.sync_api import Page

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer
from tests.service.test_whatif import doc


def test_the_selected_layers_whatif_table_matches_the_api(page: Page, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'web.db'}")
    with BackgroundServer(create_app(settings)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            http.post("/api/v1/ingest", json=doc("web", [0, 10, 11])).raise_for_status()
            http.post("/api/v1/ingest", json=doc("web", [12])).raise_for_status()
            answer = http.get("/api/v1/runs/web/whatif", params={"layer": "blocks.1.fc2"}).json()
        page.goto(f"{server.url}/#run=web&layer=blocks.1.fc2")
        page.locator("#whatif-body tr").first.wait_for()
        assert page.locator("#whatif-title").inner_text() == "What-if formats: blocks.1.fc2"
        assert page.locator("#whatif-step").inner_text() == f"step {answer['step']}"
        rows = page.locator("#whatif-body tr")
        candidates = [rows.nth(i).get_attribute("data-candidate") for i in range(rows.count())]
        by_bits = sorted({(e["bits"], e["candidate"]) for e in answer["entries"]})
        assert candidates == [c for _, c in by_bits]  # one row per candidate, fewest bits first
        own = page.locator('#whatif-body tr[data-candidate="fp4_e2m1:tensor"] td')
        assert own.nth(0).inner_text() == "fp4_e2m1:tensor (own)"
        assert own.nth(1).inner_text() == "4"
        assert own.nth(4).inner_text() == "0.7 · 54% underflow"  # the gradient's rel_l2 and underflow share
        nvfp4 = page.locator('#whatif-body tr[data-candidate="nvfp4"] td')
        assert [nvfp4.nth(i).inner_text() for i in (2, 3)] == ["0.2", "0.2"]
        page.evaluate("location.hash = '#run=web&layer=head'")
        page.wait_for_function("document.querySelector('#whatif-title').textContent.endsWith('head')")
        page.wait_for_function("!document.querySelector('#whatif-body tr[data-candidate=\"fp4_e2m1:tensor\"]')")
        head = page.locator('#whatif-body tr[data-candidate="mxfp8"] td')
        assert head.nth(4).inner_text() == "0.03 · 0.2% underflow"
        page.evaluate("location.hash = '#run=web'")
        page.locator("#whatif-empty").wait_for(state="visible")
        assert "Select a layer" in page.locator("#whatif-empty").inner_text()
