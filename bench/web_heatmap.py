"""The web view's heatmap at 512 layers × 500 columns, in headless Chromium against a real collector.

A collector (SQLite file, uvicorn in a thread) receives one run of ``--layers`` layers × ``--steps`` steps of
``output_rel_l2`` (a few layers drifting past 5%); Debian's Chromium, driven by Playwright, opens the run's view.
Printed, all measured in this one run:

* load: navigation to a drawn heatmap (runs list, run, heatmap request, colour mapping, draw), and the heatmap API
  request alone as the browser saw it (Resource Timing);
* redraw: the page's ``drawHeatmap()`` (one ImageData fill per draw) against a naive renderer measured side by side
  on the same data and canvas (one ``fillRect`` per cell), and the ratio;
* colour mapping of a new answer (``prepareHeatmap``) and one hover (tooltip for the cell under the mouse).

Run: ``.venv/bin/python bench/web_heatmap.py [--layers 512 --steps 2000 --repeats 20]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
from playwright.sync_api import sync_playwright

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
RUN = "bench-heatmap"

NAIVE_DRAW = """(repeats) => {
    // One fillRect per cell with the page's own colours: the straightforward canvas renderer.
    const hm = state.heatmap;
    const canvas = document.getElementById('heatmap');
    const ctx = canvas.getContext('2d');
    const cellW = hm.plot.w / hm.cols;
    const cellH = hm.plot.h / hm.rows;
    const times = [];
    for (let k = 0; k < repeats; k++) {
        const t0 = performance.now();
        for (let r = 0; r < hm.rows; r++) {
            for (let c = 0; c < hm.cols; c++) {
                const i = r * hm.cols + c;
                ctx.fillStyle = hm.kind[i] === 1 ? '#dde1e7'
                    : `rgb(${hm.rgb[i * 3]},${hm.rgb[i * 3 + 1]},${hm.rgb[i * 3 + 2]})`;
                ctx.fillRect(hm.plot.x + c * cellW, hm.plot.y + r * cellH, cellW, cellH);
            }
        }
        ctx.getImageData(0, 0, 1, 1);  // wait for the canvas to be painted, as drawHeatmap's putImageData does
        times.push(performance.now() - t0);
    }
    return times;
}"""

PAGE_DRAW = """(repeats) => {
    const times = [];
    for (let k = 0; k < repeats; k++) {
        const t0 = performance.now();
        drawHeatmap();
        document.getElementById('heatmap').getContext('2d').getImageData(0, 0, 1, 1);
        times.push(performance.now() - t0);
    }
    return times;
}"""

PREPARE = """(repeats) => {
    const hm = state.heatmap;
    const body = {layers: hm.layers, steps: hm.steps, values: hm.raw, bucket_steps: hm.bucketSteps};
    const times = [];
    for (let k = 0; k < repeats; k++) {
        const t0 = performance.now();
        prepareHeatmap(body, hm.metric);
        times.push(performance.now() - t0);
    }
    return times;
}"""


HOVER = """(repeats) => {
    // The mousemove handler (cell lookup, tooltip text and placement) plus the layout it forces.
    const canvas = document.getElementById('heatmap');
    const rect = canvas.getBoundingClientRect();
    const plot = JSON.parse(canvas.dataset.plot);
    const times = [];
    for (let k = 0; k < repeats; k++) {
        const event = new MouseEvent('mousemove', {
            clientX: rect.left + plot.x + plot.w * (0.1 + 0.8 * k / repeats),
            clientY: rect.top + plot.y + plot.h * (0.9 - 0.8 * k / repeats),
        });
        const t0 = performance.now();
        canvas.dispatchEvent(event);
        document.getElementById('heatmap-tooltip').getBoundingClientRect();
        times.push(performance.now() - t0);
    }
    return times;
}"""


def _ingest(url: str, layers: int, steps: int) -> int:
    names = [f"blocks.{i // 4}.{('attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2')[i % 4]}" for i in range(layers)]
    rng = np.random.default_rng(0)
    base = rng.uniform(0.005, 0.03, size=layers).astype(np.float32)
    drifting = rng.choice(layers, size=max(1, layers // 64), replace=False)
    points = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        for first in range(0, steps, 100):
            batch_steps = []
            for step in range(first, min(steps, first + 100)):
                values = base * (1 + 0.2 * np.sin(step / 40 + np.arange(layers))).astype(np.float32)
                values[drifting] += np.float32(0.08 * step / steps)
                batch_steps.append(
                    {
                        "step": step,
                        "time": 1764467200.0 + step,
                        "metrics": {"output_rel_l2": values.astype("<f4").tobytes()},
                        "scalars": {"loss": 3.0 * math.exp(-step / 500) + 0.5},
                    }
                )
                points += layers + 1
            body = msgpack.packb(
                {"run": RUN, "rank": 0, "batch_id": f"b{first}", "layers": names, "steps": batch_steps}
            )
            http.post(
                "/api/v1/ingest", content=body, headers={"Content-Type": "application/msgpack"}
            ).raise_for_status()
    return points


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ms (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"


def main() -> None:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        settings = Settings(database_url=f"sqlite:///{Path(scratch) / 'bench.db'}")
        with BackgroundServer(create_app(settings)) as server:
            started = time.perf_counter()
            points = _ingest(server.url, args.layers, args.steps)
            print(f"ingested {points} points in {time.perf_counter() - started:.1f} s")
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                loads = []
                api_ms = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    page.goto(f"{server.url}/#run={RUN}")
                    page.wait_for_selector("#heatmap[data-ready]")
                    loads.append((time.perf_counter() - t0) * 1000)
                    entries = page.evaluate(
                        "() => performance.getEntriesByType('resource')"
                        ".filter(e => e.name.includes('/heatmap?')).map(e => e.duration)"
                    )
                    api_ms.extend(entries)
                    page.goto("about:blank")
                page.goto(f"{server.url}/#run={RUN}")
                page.wait_for_selector("#heatmap[data-ready]")
                page.uncheck("#live")
                canvas = page.locator("#heatmap")
                rows, cols = int(canvas.get_attribute("data-rows") or 0), int(canvas.get_attribute("data-cols") or 0)
                ours = page.evaluate(PAGE_DRAW, args.repeats)
                naive = page.evaluate(NAIVE_DRAW, max(3, args.repeats // 4))
                page.evaluate("() => drawHeatmap()")
                prepare = page.evaluate(PREPARE, max(3, args.repeats // 4))
                hovers = page.evaluate(HOVER, args.repeats)
                browser.close()

    print(f"heatmap: {rows} layers × {cols} columns ({args.steps} steps), Chromium headless, devicePixelRatio 1")
    print(f"| load to drawn heatmap | {_ms(loads)} |")
    print(f"| heatmap API request (browser) | {_ms(api_ms)} |")
    print(f"| colour mapping of an answer (prepareHeatmap) | {_ms(prepare)} |")
    print(f"| redraw, page (one ImageData fill) | {_ms(ours)} |")
    print(f"| redraw, naive (one fillRect per cell) | {_ms(naive)} |")
    print(f"| ratio naive / page | {statistics.median(naive) / statistics.median(ours):.1f}× |")
    print(f"| hover: handler and tooltip layout | {_ms(hovers)} |")


if __name__ == "__main__":
    main()
