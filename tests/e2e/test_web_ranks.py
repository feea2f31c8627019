"""The web view's rank selector and its layers × ranks view, in Debian's Chromium, against a real collector holding a
three-rank run posted through the real ingest path (one rank drifts on one layer, skips one step and holds other
weights at one fingerprinted step)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from playwright.sync_api import Page

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer
from tests.e2e.conftest import hover_cell

RUN = "e2e/ddp"
LAYERS = ["embed", "blocks.0.fc", "blocks.1.fc", "head"]
RANKS = (0, 1, 2)
STEPS = 20
BAD = ("blocks.1.fc", 2)  # rank 2's blocks.1.fc drifts from DRIFT_STEP on
DRIFT_STEP = 10
SKIPPED = (1, 15)  # rank 1 sends nothing at step 15
FINGERPRINT_STEP = 10  # every rank sends weight fingerprints; rank 2's blocks.1.fc differs
SAME = ("00000000000000aa00000000000000bb", 1.5, 4.0)
OTHER = ("00000000000000cc00000000000000dd", 1.5, 4.41)


def value(rank: int, step: int, layer: str) -> float:
    """The float32 rank ``rank`` sent for ``layer`` at ``step``, as the API spells it (its shortest float32 text)."""
    v = 0.002 * (1 + LAYERS.index(layer)) + 0.0005 * rank + 0.00001 * step
    if (layer, rank) == BAD and step >= DRIFT_STEP:
        v = 0.2 + 0.01 * (step - DRIFT_STEP)
    return float(np.format_float_positional(np.float32(v)))


def same_float32(shown: str | None, want: float) -> bool:
    """Whether a value the page shows is the float32 sent (a heatmap with holes spells float32 values as float64)."""
    return shown is not None and np.float32(float(shown)) == np.float32(want)


def _batch(rank: int) -> dict[str, Any]:
    steps = []
    for step in range(STEPS):
        if (rank, step) == SKIPPED:
            continue
        entry: dict[str, Any] = {
            "step": step,
            "time": 1764467200.0 + step,
            "metrics": {"output_rel_l2": [value(rank, step, layer) for layer in LAYERS]},
            "scalars": {"loss": 2.0 - 0.01 * step + 0.1 * rank},
        }
        if step == FINGERPRINT_STEP:
            prints = [OTHER if (layer, rank) == BAD else SAME for layer in LAYERS]
            entry["fingerprints"] = {
                "group": list(RANKS),
                "hash": [p[0] for p in prints],
                "sum": [p[1] for p in prints],
                "sumsq": [p[2] for p in prints],
            }
        steps.append(entry)
    return {"run": RUN, "rank": rank, "batch_id": f"ddp-{rank}", "layers": LAYERS, "steps": steps}


@pytest.fixture(scope="module")
def ddp_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A collector on loopback holding the three-rank run; its base URL."""
    database = tmp_path_factory.mktemp("ddp") / "quantwatch.db"
    with BackgroundServer(create_app(Settings(database_url=f"sqlite:///{database}"))) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for rank in RANKS:
                http.post("/api/v1/ingest", json=_batch(rank)).raise_for_status()
        yield server.url


def _open(page: Page, url: str, **state: str) -> None:
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in {"run": RUN, **state}.items())
    page.goto(f"{url}/#{query}")
    page.wait_for_selector("#heatmap[data-ready]")


def _heatmap_redrawn(page: Page, before: str | None) -> None:
    page.wait_for_function(
        "(before) => { const c = document.getElementById('heatmap'); return c.dataset.ready !== before && "
        "!c.hasAttribute('aria-busy'); }",
        arg=before,
    )


def _last_column(page: Page) -> int:
    return int(page.locator("#heatmap").get_attribute("data-cols") or 0) - 1


def test_the_rank_selector_switches_what_the_heatmap_and_the_history_show(page: Page, ddp_collector: str) -> None:
    _open(page, ddp_collector, metric="output_rel_l2", layer=BAD[0])
    assert page.locator("#rank-label").is_visible()
    options = page.locator("#rank option").evaluate_all("(os) => os.map((o) => o.value)")
    assert options == ["all", "0", "1", "2"]
    row = LAYERS.index(BAD[0])
    last = STEPS - 1

    # Default: rank 0, whose blocks.1.fc never drifts.
    shown = hover_cell(page, row, _last_column(page))
    assert shown["step"] == str(last)
    assert same_float32(shown["value"], value(0, last, BAD[0]))
    assert shown["rank"] == ""

    # Every rank: each cell is its worst rank's value, and the tooltip names that rank.
    before = page.locator("#heatmap").get_attribute("data-ready")
    page.select_option("#rank", "all")
    page.wait_for_function("() => location.hash.includes('rank=all')")
    _heatmap_redrawn(page, before)
    shown = hover_cell(page, row, _last_column(page))
    assert same_float32(shown["value"], value(2, last, BAD[0]))
    assert shown["rank"] == "2"
    assert "rank 2" in (shown["text"] or "")
    assert page.locator("#heatmap-info").inner_text().endswith("the worst of 3 ranks")
    shown = hover_cell(page, LAYERS.index("head"), _last_column(page))
    assert same_float32(shown["value"], value(2, last, "head"))  # the highest rank sends the highest values
    page.wait_for_function("() => document.getElementById('series').dataset.lines?.includes('rank 2')")
    assert json.loads(page.locator("#series").get_attribute("data-lines") or "[]") == ["rank 0", "rank 1", "rank 2"]

    # One other rank: its own values, and the history draws that rank only.
    before = page.locator("#heatmap").get_attribute("data-ready")
    page.select_option("#rank", "1")
    _heatmap_redrawn(page, before)
    shown = hover_cell(page, row, _last_column(page))
    assert same_float32(shown["value"], value(1, last, BAD[0]))
    one_line = "() => document.getElementById('series').dataset.lines === JSON.stringify(['output_rel_l2'])"
    page.wait_for_function(one_line)

    # The link reproduces the selection.
    link = page.evaluate("() => location.href")
    page.goto("about:blank")
    page.goto(link.replace("rank=1", "rank=all"))
    page.wait_for_selector("#heatmap[data-ready]")
    assert page.locator("#rank").input_value() == "all"
    assert hover_cell(page, row, _last_column(page))["rank"] == "2"


def _grid(page: Page) -> dict[tuple[str, int], dict[str, str]]:
    cells = page.locator("#ranks-table td").evaluate_all(
        "(tds) => tds.map((td) => ({layer: td.parentElement.dataset.layer, rank: td.dataset.rank, "
        "value: td.dataset.value, cls: td.className, background: td.style.background}))"
    )
    return {(c["layer"], int(c["rank"])): c for c in cells}


def test_the_layers_by_ranks_view_shows_each_rank_and_hatches_the_one_that_did_not_report(
    page: Page, ddp_collector: str
) -> None:
    _open(page, ddp_collector, metric="output_rel_l2", step=str(SKIPPED[1]))
    page.wait_for_selector(f"#ranks-table[data-step='{SKIPPED[1]}']")
    heads = page.locator("#ranks-table tr th").all_inner_texts()
    assert heads[:4] == ["layer", "rank 0", "rank 1", "rank 2"]
    grid = _grid(page)
    assert set(grid) == {(layer, rank) for layer in LAYERS for rank in RANKS}
    for (layer, rank), cell in grid.items():
        if rank == SKIPPED[0]:
            assert cell["value"] == "null"
            assert "nodata" in cell["cls"]
            assert cell["background"] == ""
        else:
            assert float(cell["value"]) == value(rank, SKIPPED[1], layer)
            assert cell["background"].startswith("rgb(")
    # The drifting cell is past the shipped 5% rule: drawn in a different colour from its healthy neighbours.
    assert grid[BAD].get("background") != grid[(BAD[0], 0)]["background"]

    # A step typed in the step box.
    page.fill("#rank-step", "3")
    page.dispatch_event("#rank-step", "change")
    page.wait_for_selector("#ranks-table[data-step='3']")
    assert "step=3" in page.evaluate("() => location.hash")
    grid = _grid(page)
    assert all(float(c["value"]) == value(rank, 3, layer) for (layer, rank), c in grid.items())

    # A heatmap column clicked: the view moves to that column's step.
    hover_cell(page, 0, 6)
    page.mouse.down()
    page.mouse.up()
    page.wait_for_selector("#ranks-table[data-step='6']")


def test_weights_that_differ_across_ranks_are_listed_and_outlined(page: Page, ddp_collector: str) -> None:
    answer = httpx.get(f"{ddp_collector}/api/v1/runs/{quote(RUN, safe='')}/ranks").json()
    assert [(m["step"], m["layer"], m["ranks"]) for m in answer["mismatches"]] == [(FINGERPRINT_STEP, BAD[0], [2])]
    _open(page, ddp_collector, metric="output_rel_l2", step="0")
    link = page.locator("#ranks-mismatches a")
    link.wait_for()
    assert link.inner_text() == f"step {FINGERPRINT_STEP} {BAD[0]} (rank 2 ≠ rank 0)"
    link.click()
    page.wait_for_selector(f"#ranks-table[data-step='{FINGERPRINT_STEP}']")
    assert "metric=rank_weight_mismatch" in page.evaluate("() => location.hash")
    grid = _grid(page)
    assert float(grid[BAD]["value"]) > 0
    assert "differs" in grid[BAD]["cls"]
    assert [key for key, cell in grid.items() if "differs" in cell["cls"]] == [BAD]
    assert {cell["value"] for key, cell in grid.items() if key != BAD} == {"0"}


def test_a_single_rank_run_shows_no_rank_selector_nor_ranks_view(page: Page, collector: Any) -> None:
    page.goto(f"{collector.url}/#run={quote(collector.run, safe='')}&rank=all&step=5")
    page.wait_for_selector("#heatmap[data-ready]")
    assert page.locator("#rank-label").is_hidden()
    assert page.locator("#ranks-card").is_hidden()
    # rank=all in the link of a one-rank run falls back to the run's rank: the heatmap holds its values.
    assert hover_cell(page, 0, 5)["rank"] == ""
