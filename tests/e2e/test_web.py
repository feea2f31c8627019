"""The web view in a real browser (headless Debian Chromium driven by Playwright) against a real collector."""

from __future__ import annotations

import fnmatch
import json
import random
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from playwright.sync_api import Page

from quantwatch.service import Settings, create_app
from quantwatch.service.alerts.rules import breaches
from quantwatch.service.server import BackgroundServer
from tests.e2e.conftest import hover_cell

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def _open_run(page: Page, collector: Any) -> list[str]:
    """Open the run's view; return the heatmap API URLs the page requested."""
    heatmap_requests: list[str] = []
    page.on("request", lambda r: heatmap_requests.append(r.url) if "/heatmap?" in r.url else None)
    page.goto(f"{collector.url}/#run={quote(collector.run, safe='')}")
    page.wait_for_selector("#heatmap[data-rows]")
    return heatmap_requests


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
    shown = hover_cell(page, row, column)
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
    shown = hover_cell(page, hole_row, hole_column)
    assert shown["value"] == "null"
    assert "not measured" in (shown["text"] or "")

    # Clicking a cell selects its layer and step for the series chart.
    page.mouse.down()
    page.mouse.up()
    page.wait_for_function("() => location.hash.includes('step=')")
    # The hash changes at once, the title on the hashchange event that follows.
    page.wait_for_function(
        "(layer) => document.getElementById('series-title').innerText.startsWith(layer)", arg=hole_layer
    )
    assert page.locator("#series-title").inner_text().startswith(hole_layer)

    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#alerts-body tr").first.wait_for()
    hover_cell(page, row, column)
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


def test_without_a_token_the_runs_list_asks_for_one(page: Page, secured_collector: Any) -> None:
    """A collector that wants a token has not said it holds no runs: the list asks for the token instead."""
    page.goto(f"{secured_collector.url}/")
    page.locator("#runs-locked").wait_for(state="visible")
    assert "token" in page.locator("#runs-locked").inner_text()
    assert page.locator("#runs-empty").is_hidden()
    page.fill("#token-input", secured_collector.read_token)
    page.click("#token-form button")
    page.locator(f'#runs-list a[data-run="{secured_collector.run}"]').wait_for()
    assert page.locator("#runs-locked").is_hidden()


def test_empty_collector_says_how_to_get_runs(page: Page, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}")
    with BackgroundServer(create_app(settings)) as server:
        page.goto(f"{server.url}/")
        empty = page.locator("#runs-empty")
        empty.wait_for(state="visible")
        assert "quantwatch demo" in empty.inner_text()
        assert page.locator("#welcome").is_visible()
        assert page.locator("#banner").is_hidden()


def _grid_colours(page: Page) -> list[list[tuple[int, int, int]]]:
    """The colour drawn at the centre of every heatmap cell, row by row."""
    grid: list[list[list[int]]] = page.evaluate(
        """() => {
            const c = document.getElementById('heatmap');
            const plot = JSON.parse(c.dataset.plot);
            const rows = Number(c.dataset.rows);
            const cols = Number(c.dataset.cols);
            const dpr = window.devicePixelRatio || 1;
            const ctx = c.getContext('2d');
            const at = (r, col) => {
                const x = (plot.x + (col + 0.5) * plot.w / cols) * dpr;
                const y = (plot.y + (r + 0.5) * plot.h / rows) * dpr;
                return Array.from(ctx.getImageData(Math.floor(x), Math.floor(y), 1, 1).data.slice(0, 3));
            };
            return Array.from({length: rows}, (_, r) => Array.from({length: cols}, (_, col) => at(r, col)));
        }"""
    )
    return [[(r, g, b) for r, g, b in row] for row in grid]


def _cell_colours(page: Page) -> list[tuple[int, int, int]]:
    """The colour drawn at the centre of the last column's cell of every heatmap row."""
    return [row[-1] for row in _grid_colours(page)]


def _kind_of(colour: tuple[int, int, int]) -> str:
    r, g, b = colour
    if r == g == b:
        return "unwatched"
    return "past" if r > b + 40 else "within"


def _expected_kinds(rules: list[dict[str, Any]], layers: list[str], values: list[float | None]) -> list[str]:
    """How each row's cell should look: decided by the collector's own breach test on the float32 value."""
    kinds = []
    for layer, value in zip(layers, values, strict=True):
        watching = [rule for rule in rules if any(fnmatch.fnmatchcase(layer, g) for g in _globs(rule))]
        if not watching:
            kinds.append("unwatched")
            continue
        (rule,) = watching
        assert value is not None
        past = breaches(float(np.float32(value)), rule["op"], rule["threshold"])
        kinds.append("past" if past else "within")
    return kinds


def test_rule_bounds_colour_each_row_and_mark_the_chart(
    page: Page, tmp_path: Path, short_run: list[dict[str, Any]]
) -> None:
    """Every heatmap row is coloured against the bound of the rule that watches its layer, in either direction, and
    grey where no rule does; the layer chart draws the bounds that apply to its layer."""
    run, layers = short_run[0]["run"], short_run[0]["layers"]
    rules = [
        {"name": "ufl_high_b0", "metric": "underflow_ratio", "layers": "blocks.0.*", "op": ">", "threshold": 0.0015},
        # float32(0.001) is 0.00100000005 > 0.001: the collector calls it a breach, and so must the page.
        {
            "name": "ufl_high_b1",
            "metric": "underflow_ratio",
            "layers": ["blocks.1.attn.*"],
            "op": ">",
            "threshold": 0.001,
        },
        {"name": "ufl_low_b2", "metric": "underflow_ratio", "layers": "blocks.2.*", "op": "<", "threshold": 0.0015},
    ]
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'rules.db'}")
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        for rule in rules:
            http.post("/api/v1/rules", json=rule).raise_for_status()
        for batch in short_run:
            http.post("/api/v1/ingest", json=batch).raise_for_status()
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=underflow_ratio")
        page.wait_for_selector("#heatmap[data-rows]")
        answer = http.get(f"/api/v1/runs/{quote(run, safe='')}/heatmap", params={"metric": "underflow_ratio"}).json()

        expected = _expected_kinds(rules, layers, [row[-1] for row in answer["values"]])
        assert {"unwatched", "past", "within"} <= set(expected)
        assert expected[layers.index("blocks.1.attn.qkv")] == "past"  # the float32 case above
        assert [_kind_of(colour) for colour in _cell_colours(page)] == expected

        # The tooltip names the rule of the hovered row and whether its value is past the bound.
        row = expected.index("past")
        shown = hover_cell(page, row, len(answer["steps"]) - 1)
        assert "(past it)" in (shown["text"] or "")
        rule_name = next(r["name"] for r in rules if any(fnmatch.fnmatchcase(layers[row], g) for g in _globs(r)))
        assert rule_name in (shown["text"] or "")

        # The layer chart of the drifting layer draws the shipped 5% output rule; a layer far below it does not.
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=output_rel_l2&layer=blocks.1.mlp.fc1")
        page.wait_for_function("() => document.getElementById('series').dataset.bounds === '[\"> 5%\"]'")
        assert page.locator("#metric").input_value() == "output_rel_l2"  # the picker follows the URL
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=output_rel_l2&layer=blocks.0.attn.qkv")
        page.wait_for_function("() => document.getElementById('series').dataset.bounds === '[]'")


def test_a_floor_rule_keeps_a_one_step_dip_visible_in_a_bucketed_heatmap(page: Page, tmp_path: Path) -> None:
    """For a metric where high is good, buckets show their worst (lowest) step by default: one dip of update_cosine
    below the rule's 0.95 floor, inside a bucket of several steps, is painted past the bound."""
    run, layers, steps, dip = "e2e/cosine", ["l0", "l1"], 1024, (1, 701)
    values = np.full((steps, len(layers)), 0.99, dtype=np.float32)
    values[dip[1], dip[0]] = 0.90
    batches = [
        {
            "run": run,
            "batch_id": f"cos-{first}",
            "layers": layers,
            "steps": [
                {"step": step, "metrics": {"update_cosine": values[step].tolist()}}
                for step in range(first, first + 256)
            ],
        }
        for first in range(0, steps, 256)
    ]
    rule = {"name": "floor", "metric": "update_cosine", "op": "<", "threshold": 0.95, "layers": "*"}
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'cosine.db'}")
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/api/v1/rules", json=rule).raise_for_status()
        for batch in batches:
            http.post("/api/v1/ingest", json=batch).raise_for_status()
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url) if "/heatmap?" in r.url else None)
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=update_cosine")
        page.wait_for_selector("#heatmap[data-rows]")
        assert "agg=min" in requests[-1]
        answer = httpx.get(requests[-1]).json()
        assert answer["bucket_steps"] > 1
        column = max(c for c, first in enumerate(answer["steps"]) if first <= dip[1])
        assert answer["values"][dip[0]][column] == pytest.approx(0.90)
        colours = page.evaluate(
            """(column) => {
                const c = document.getElementById('heatmap');
                const plot = JSON.parse(c.dataset.plot);
                const cols = Number(c.dataset.cols);
                const x = Math.floor(plot.x + (column + 0.5) * plot.w / cols);
                const at = (r) => c.getContext('2d').getImageData(x, Math.floor(plot.y + (r + 0.5) * plot.h / 2), 1, 1);
                return [0, 1].map((r) => Array.from(at(r).data.slice(0, 3)));
            }""",
            column,
        )
        assert [_kind_of((r, g, b)) for r, g, b in colours] == ["within", "past"]


def _globs(rule: dict[str, Any]) -> list[str]:
    layers = rule["layers"]
    return [layers] if isinstance(layers, str) else list(layers)


def test_rule_globs_match_as_the_collector_matches_them(page: Page, collector: Any) -> None:
    """The page's glob matcher agrees with Python's fnmatch.fnmatchcase, which the collector's rules use."""
    patterns = [
        "*",
        "blocks.*",
        "blocks.?.mlp.*",
        "blocks.[01].*",
        "blocks.[!0].attn.*",
        "blocks.[0-1].mlp.fc[12]",
        "a+b*",
        "(x)|y",
        "[]]",
        "[!]]x",
        "[a",
        "a]",
        "*.fc?",
        "a\\b",
        "a-b",
        "[a-c-]z",
        "^x$",
        "[^a]",
        "",
        "BLOCKS.*",
    ]
    names = [
        "blocks.0.mlp.fc1",
        "blocks.1.attn.qkv",
        "blocks.2.attn.proj",
        "blocks.10.mlp.fc2",
        "a+bc",
        "aab",
        "(x)|y",
        "x",
        "]",
        "]x",
        "ax",
        "[a",
        "a]",
        "head.fc1",
        "a\\b",
        "a-b",
        "az",
        "-z",
        "dz",
        "^x$",
        "^",
        "b",
        "",
    ]
    tricky = ["[8-11]", "[z-a]", "[!z-a]", "[%-!]", "[a-]", "[-a]", "[!-]", "[b-a-c]", "[]-a]", "?", "[!a]", "[[]"]
    rng = random.Random(7)
    alphabet = [*"ab81-!]^[\\z%*?.", "\N{GRINNING FACE}"]
    generated = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(400)]
    patterns += [p for p in tricky + generated if _compiles(p)]
    names += ["8", "1", "9", "-", "!", "\N{GRINNING FACE}", "blocks.1.mlp", "blocks.8.mlp", "[", "%", "cz"]
    names += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(40)]
    _open_run(page, collector)
    got = page.evaluate(
        "([patterns, names]) => patterns.map((p) => names.map((n) => globMatches(p, n)))", [patterns, names]
    )
    assert got == [[fnmatch.fnmatchcase(n, p) for n in names] for p in patterns]


def _compiles(pattern: str) -> bool:
    """Whether the collector accepts ``pattern`` as a rule glob (fnmatch's regex compiles)."""
    try:
        re.compile(fnmatch.translate(pattern))
    except re.error:
        return False
    return True


def test_the_page_serves_its_modules_as_javascript(collector: Any) -> None:
    """Browsers refuse a module script served under any other content type; pyproject's ``static/*`` ships them."""
    static = Path(__file__).resolve().parents[2] / "service" / "static"
    page = httpx.get(f"{collector.url}/").text
    assert '<script type="module" src="static/main.js">' in page
    modules = sorted(p.name for p in static.glob("*.js"))
    assert "main.js" in modules
    assert len(modules) > 5
    for name in modules:
        answer = httpx.get(f"{collector.url}/static/{name}")
        assert answer.status_code == 200, name
        assert answer.headers["content-type"].startswith("text/javascript"), name
    pyproject = (static.parents[1] / "pyproject.toml").read_text()
    assert '"static/*"' in pyproject
    assert not [p for p in static.iterdir() if p.is_dir()]  # a subfolder would escape the static/* glob


def _catalog_view(page: Page, collector: Any, metric: str) -> tuple[str, list[tuple[int, int, int]], str]:
    """Open ``metric`` of the short run: the heatmap request's URL, the last column's colours, a tooltip's text."""
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "/heatmap?" in r.url else None)
    page.goto("about:blank")  # a fresh load of the page, which reads the catalogue again
    page.goto(f"{collector.url}/#run={quote(collector.run, safe='')}&metric={metric}")
    page.wait_for_selector("#heatmap[data-rows]")
    row = 1  # underflow_ratio 0.001, output_rel_l2 about 0.008 there
    shown = hover_cell(page, row, collector.steps - 1)
    return requests[-1], _cell_colours(page), shown["text"] or ""


def test_polarity_ratio_and_meaning_come_from_the_catalog(page: Page, collector: Any) -> None:
    """The page asks the collector's catalogue which direction is bad and which figures are ratios: served a
    catalogue that says otherwise, it follows it; a metric the catalogue does not name is higher-is-worse, no ratio."""
    catalog_requests: list[str] = []
    page.on("request", lambda r: catalog_requests.append(r.url) if r.url.endswith("/api/v1/catalog") else None)
    catalog = httpx.get(f"{collector.url}/api/v1/catalog").json()
    underflow = next(m for m in catalog["metrics"] if m["name"] == "underflow_ratio")

    # The real catalogue: underflow_ratio is higher-is-worse and a ratio. No rule watches it: a sequential scale,
    # its highest values (0.002, rows 2, 5, …) yellow at the hot end.
    heatmap, colours, text = _catalog_view(page, collector, "underflow_ratio")
    assert catalog_requests
    assert "agg=max" in heatmap
    assert "(0.100%)" in text
    assert colours[2][0] > 200
    assert colours[2][2] < 100
    title = page.locator('#metric option[value="underflow_ratio"]').get_attribute("title")
    assert title == f"{underflow['meaning']} ({underflow['formula']})"

    # A catalogue that calls it lower-is-worse and not a ratio, without output_rel_l2: the scale turns round (its
    # highest values at the cold end), buckets show their minimum, values lose their percentage.
    flipped = {
        "metrics": [
            {**m, "polarity": "lower_is_worse", "is_ratio": False, "unit": "share"} if m is underflow else m
            for m in catalog["metrics"]
            if m["name"] != "output_rel_l2"
        ],
        "scalars": catalog["scalars"],
    }
    page.route("**/api/v1/catalog", lambda route: route.fulfill(json=flipped))
    heatmap, colours, text = _catalog_view(page, collector, "underflow_ratio")
    assert "agg=min" in heatmap
    assert "0.001" in text
    assert "%" not in text
    assert colours[2][0] < 100
    assert colours[2][2] > 60

    # output_rel_l2, unknown to that catalogue, falls back to higher-is-worse and non-ratio, and no meaning.
    heatmap, _, text = _catalog_view(page, collector, "output_rel_l2")
    assert "agg=max" in heatmap
    assert "output_rel_l2" in text
    assert "%" not in text.split("output_rel_l2", 1)[1].split("\n", 1)[0]
    assert page.locator('#metric option[value="output_rel_l2"]').get_attribute("title") == ""


def test_each_row_and_legend_bar_shows_its_own_bound(
    page: Page, tmp_path: Path, short_run: list[dict[str, Any]]
) -> None:
    """Rows held to 25% and rows held to 5% each get a legend bar of their own bound and show it next to their name;
    the run's facts count its ranks."""
    run, layers = short_run[0]["run"], short_run[0]["layers"]
    output = {"metric": "output_rel_l2", "op": ">", "consecutive": 3}
    rules_file = tmp_path / "rules.yaml"
    rules = [
        {**output, "name": "quantwatch_output_deviation", "threshold": 0.05, "layers": ["blocks.0.*", "blocks.2.*"]},
        {**output, "name": "fp4_output_deviation", "threshold": 0.25, "layers": "blocks.1.*"},
    ]
    rules_file.write_text(json.dumps({"default_rules": True, "rules": rules}))
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'bounds.db'}", rules_file=rules_file)
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        for batch in short_run:
            http.post("/api/v1/ingest", json=batch).raise_for_status()
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=output_rel_l2")
        page.wait_for_selector("#heatmap[data-rows]")
        assert json.loads(page.locator("#legend").get_attribute("data-bars") or "[]") == [
            "> 5% · 8 layers",
            "> 25% · 4 layers",
        ]
        row_bounds = json.loads(page.locator("#heatmap").get_attribute("data-row-bounds") or "[]")
        assert row_bounds == ["> 25%" if layer.startswith("blocks.1.") else "> 5%" for layer in layers]
        # The drifting layer (6-12%) is past 5% but within its own 25%: coloured within, as its row says.
        assert _kind_of(_cell_colours(page)[layers.index("blocks.1.mlp.fc1")]) == "within"
        facts = page.locator("#run-facts").inner_text()
        assert "1 rank" in facts


def test_a_sampled_run_draws_the_sampled_steps(page: Page, tmp_path: Path) -> None:
    """A run the agent sampled every 10 steps: one column per sampled step, hatched only where a layer is missing
    from a step the others were measured at; the layer chart draws the same steps."""
    run, layers, every, last = "e2e/sampled", ["l0", "l1", "l2", "l3"], 10, 90
    hole = (2, 40)
    steps = [
        {
            "step": step,
            "metrics": {"output_rel_l2": [None if (i, step) == hole else 0.01 * (i + 1) for i in range(len(layers))]},
        }
        for step in range(0, last + 1, every)
    ]
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'sampled.db'}")
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        batch = {"run": run, "batch_id": "s", "layers": layers, "steps": steps}
        http.post("/api/v1/ingest", json=batch).raise_for_status()
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=output_rel_l2&layer=l0")
        page.wait_for_selector("#heatmap[data-rows]")
        grid = _grid_colours(page)
        hatch = {(205, 210, 218), (238, 240, 243)}  # HATCH_DARK, HATCH_LIGHT of colour.js
        hatched = sum(colour in hatch for row in grid for colour in row)
        sampled = last // every + 1
        assert page.locator("#heatmap").get_attribute("data-cols") == str(sampled)
        assert len(grid[0]) == sampled
        assert hatched >= 1  # the hole itself
        assert hatched / (len(grid) * len(grid[0])) <= 1 / (len(layers) * sampled)
        shown = hover_cell(page, hole[0], hole[1] // every)
        assert shown["step"] == str(hole[1])
        assert "not measured" in (shown["text"] or "")
        page.wait_for_function("() => document.getElementById('series')._chart")
        drawn = page.evaluate("() => document.getElementById('series')._chart.spec.lines[0].steps")
        assert drawn == list(range(0, last + 1, every))


def test_rows_show_their_layer_format_and_the_bound_of_the_rule_selecting_that_format(
    page: Page, tmp_path: Path
) -> None:
    """An FP8 and an NVFP4 layer (and one of unknown format) each show their format next to their name and are
    coloured against the rule that selects them by format, as the collector selects them: globs over any kind's
    format unless ``format_kind`` names one; a layer of unknown format matches no ``formats:`` rule and no
    ``exclude_formats:`` rule excludes it."""
    run, layers = "e2e/formats", ["blocks.0.fc8", "blocks.0.fc4", "head"]
    fp8 = {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
    fp4 = {"weight": "nvfp4", "input": "nvfp4", "grad": "fp8_e5m2:tensor"}
    output = {"metric": "output_rel_l2", "op": ">", "consecutive": 3}
    rules = [
        {**output, "name": "fp8_bound", "threshold": 0.05, "formats": ["fp8*"], "format_kind": "weight"},
        {**output, "name": "fp4_bound", "threshold": 0.25, "formats": ["nvfp4"]},
        {**output, "name": "high_bit_bound", "threshold": 0.1, "exclude_formats": ["nvfp4*"]},
        # fp8_e5m2 is only the gradients' format: a rule on the weight's takes none of these layers.
        {**output, "name": "e5m2_weights", "threshold": 0.01, "formats": ["fp8_e5m2*"], "format_kind": "weight"},
    ]
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(json.dumps({"default_rules": False, "rules": rules}))
    values = [0.07, 0.2, 0.07]
    batch = {
        "run": run,
        "batch_id": "formats-1",
        "layers": layers,
        "layer_formats": [fp8, fp4, None],
        "steps": [{"step": step, "metrics": {"output_rel_l2": values}} for step in range(1, 5)],
    }
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'formats.db'}", rules_file=rules_file)
    with BackgroundServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/api/v1/ingest", json=batch).raise_for_status()
        page.goto(f"{server.url}/#run={quote(run, safe='')}&metric=output_rel_l2")
        page.wait_for_selector("#heatmap[data-rows]")
        canvas = page.locator("#heatmap")
        assert json.loads(canvas.get_attribute("data-row-formats") or "[]") == ["fp8_e4m3", "nvfp4", ""]
        assert json.loads(canvas.get_attribute("data-row-bounds") or "[]") == ["> 5%", "> 25%", "> 10%"]
        # 7% is past the FP8 layer's 5% and within the unknown layer's 10%; 20% is within the FP4 layer's 25%.
        assert [_kind_of(colour) for colour in _cell_colours(page)] == ["past", "within", "within"]
        shown = hover_cell(page, 1, 0)
        assert "weight nvfp4, input nvfp4, grad fp8_e5m2:tensor" in (shown["text"] or "")
        assert "fp4_bound" in (shown["text"] or "")
        assert "formats" not in (hover_cell(page, 2, 0)["text"] or "")
