"""Every query of every dashboard panel and every Prometheus rule, executed for real.

A collector on loopback (the default SQLite setup) is fed two runs: a short training run of a small FP4 model with the
real agent attached (``quantwatch.agent.attach``), and agent-encoded batches (msgpack, float32 arrays) in which one
layer deviates for several steps, one layer produces non-finite values and the loss drifts from its FP32 shadow
(situations a few seconds of training cannot be counted on to produce). A real ``prometheus`` scrapes it every second
with the shipped rules loaded. Then, for both runs:

* every PromQL target, annotation and variable query of the generated dashboards, with Grafana's variables
  interpolated (every value of ``$metric`` for repeated panels), runs against that Prometheus and must return data
  with at least one finite value;
* every Infinity target (the collector history: heatmaps, layer series, the layer variable) is requested from the
  collector and its JSONata selector evaluated (jsonata-python): it must yield rows;
* every recording and alerting rule expression returns data, and the three alerts equivalent to the collector's
  default rules fire in Prometheus.

The training run has no FP32 shadow model, so the queries of the shadow's loss are expected empty for it alone.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonata
import msgpack
import numpy as np
import pytest
import yaml

from quantwatch.service import Settings, create_app
from quantwatch.service.server import BackgroundServer, free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
RULES = DASHBOARDS / "prometheus" / "rules" / "quantwatch.rules.yml"
RUN = "gpt-fp4/e2e"
AGENT_RUN = "mlp-fp4/agent"
LAYERS = [f"blocks.{i // 2}.{('attn.qkv', 'mlp.fc1')[i % 2]}" for i in range(16)]
DEVIATING = 5  # output_rel_l2 above 5% from step 4 on
NONFINITE = 9  # non-finite values from step 6 on
LOW_BIT = 7  # an NVFP4 layer (the others are FP8) whose output deviation doubles its own start from step 6 on
UPDATE_DRIFT = 3  # update direction and update noise past their bounds from step 4 on
MISMATCH = 11  # replicas' weights disagree from step 5 on (what the collector's cross-rank check reports)
FP8 = {"weight": "fp8_e4m3:tensor", "input": "fp8_e4m3:tensor", "grad": "fp8_e5m2:tensor"}
NVFP4 = {"weight": "nvfp4", "input": "nvfp4", "grad": "fp8_e5m2:tensor"}
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is for a 1 s scrape interval, rounded up
EXPECTED_ALERTS = {
    "QuantWatchOutputDeviation",
    "QuantWatchNonFinite",
    "QuantWatchLossDivergence",
    "QuantWatchOutputDeviationLowBit",
    "QuantWatchUpdateDirection",
    "QuantWatchUpdateNoise",
    "QuantWatchRankWeightMismatch",
}


def agent_batch(steps: range, rng: np.random.Generator) -> bytes:
    """One batch in the agent's binary encoding: every metric of every layer as little-endian float32 bytes."""
    n = len(LAYERS)
    out = []
    for step in steps:
        rel = (0.01 + 0.03 * rng.random(n)).astype(np.float32)
        if step >= 4:
            rel[DEVIATING] = 0.09
        if step >= 6:
            rel[LOW_BIT] = 0.09
        update_cosine = (0.99 + 0.009 * rng.random(n)).astype(np.float32)
        update_rel_l2 = (0.05 + 0.1 * rng.random(n)).astype(np.float32)
        if step >= 4:
            update_cosine[UPDATE_DRIFT], update_rel_l2[UPDATE_DRIFT] = 0.9, 0.7
        nonfinite = np.zeros(n, np.float32)
        if step >= 6:
            nonfinite[NONFINITE] = 2
        mismatch = np.zeros(n, np.float32)
        if step >= 5:
            mismatch[MISMATCH] = 1e-3
        metrics = {
            "output_rel_l2": rel,
            "output_cosine": (1 - rel**2 / 2).astype(np.float32),
            "output_sqnr_db": (-20 * np.log10(rel)).astype(np.float32),
            "update_cosine": update_cosine,
            "update_rel_l2": update_rel_l2,
            "weight_rel_l2": (0.005 + 0.01 * rng.random(n)).astype(np.float32),
            "act_rel_l2": (0.01 + 0.02 * rng.random(n)).astype(np.float32),
            "grad_rel_l2": (0.02 + 0.05 * rng.random(n)).astype(np.float32),
            "underflow_ratio": (0.001 * rng.random(n)).astype(np.float32),
            "overflow_ratio": (0.0001 * rng.random(n)).astype(np.float32),
            "nonfinite_count": nonfinite,
            "rank_weight_mismatch": mismatch,
            "amax": (1 + 10 * rng.random(n)).astype(np.float32),
            "scale": (2.0 ** rng.integers(-8, 8, n)).astype(np.float32),
        }
        loss = 3.0 - 0.01 * step
        shadow = loss / 1.08 if step >= 5 else loss
        out.append(
            {
                "step": step,
                "time": time.time(),
                "metrics": {name: values.astype("<f4").tobytes() for name, values in metrics.items()},
                "scalars": {
                    "loss": loss,
                    "loss_shadow": shadow,
                    "tokens_per_second": 12_000.0 + step,
                    "step_seconds": 0.25,
                    "device_memory_bytes": 3.2e9,
                },
            }
        )
    formats = [NVFP4 if index == LOW_BIT else FP8 for index in range(len(LAYERS))]
    doc = {
        "run": RUN,
        "rank": 0,
        "batch_id": uuid.uuid4().hex,
        "layers": LAYERS,
        "layer_formats": formats,
        "steps": out,
    }
    if steps.start <= 4 < steps.stop:  # the agent acts on the deviating layer (qw.actions): the actions annotation
        doc["actions"] = [{"step": 4, "action": "keep_high_precision", "layer": LAYERS[DEVIATING], "detail": "fp8"}]
    return msgpack.packb(doc, use_bin_type=True)


def train_with_agent(url: str, spool: Path) -> None:
    """A few optimizer steps of a small MLP whose linear layers quantize weights and inputs to FP4, agent attached."""
    import torch
    from torch import nn

    import quantwatch.agent as qw
    from quantwatch.kernels import QuantConfig, QuantSpec, Recipe, quantize_model

    torch.manual_seed(0)
    fp4 = QuantSpec("fp4_e2m1", scaling="tensor")
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    model = quantize_model(model, Recipe(rules=[("*", QuantConfig(weight=fp4, input=fp4))]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = qw.attach(
        model, run=AGENT_RUN, url=url, every=1, tokens_per_step=64, spool_dir=spool, flush_interval_seconds=0.2
    )
    x, y = torch.randn(64, 32), torch.randn(64, 8)
    for step in range(8):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 4:  # an action of the real agent: the actions annotation has it
            qw.actions.keep_high_precision("4", format="fp8", monitor=monitor)
        monitor.step(step, loss=loss)
    assert monitor.close(30)
    stats = monitor.stats()
    assert stats["sent_batches"] > 0
    assert stats["failures"] == {}


class Feeder:
    """Sends consecutive batches of 3 steps to the collector, like an agent flushing during training."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rng = np.random.default_rng(6)
        self.steps = itertools.count(1)

    def send(self) -> None:
        first = next(self.steps)
        for _ in range(2):
            next(self.steps)
        response = httpx.post(
            f"{self.url}/api/v1/ingest",
            content=agent_batch(range(first, first + 3), self.rng),
            headers={"Content-Type": "application/msgpack"},
            timeout=30,
        )
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prometheus_binary: str) -> Iterator[dict[str, Any]]:
    """A fed collector and a real Prometheus scraping it with the shipped rules; yields their URLs."""
    tmp = tmp_path_factory.mktemp("stack")
    app = create_app(Settings(database_url=f"sqlite:///{tmp / 'quantwatch.db'}"))
    collector = BackgroundServer(app).start()
    feeder = Feeder(collector.url)
    for _ in range(3):
        feeder.send()
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "quantwatch", "static_configs": [{"targets": [collector.url.removeprefix("http://")]}]}
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prometheus = f"http://127.0.0.1:{port}"
    try:
        train_with_agent(collector.url, tmp / "spool")
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp / "prometheus.log").read_text()
            assert time.monotonic() < deadline, (
                "Prometheus did not scrape and fire in time: " + (tmp / "prometheus.log").read_text()[-2000:]
            )
            feeder.send()
            time.sleep(0.5)
            try:
                firing = instant(prometheus, 'ALERTS{alertstate="firing"}')
                scrapes = instant(prometheus, 'count_over_time(up{job="quantwatch"}[1m])')
            except httpx.HTTPError:
                continue
            names = {series["metric"]["alertname"] for series in firing}
            if names >= EXPECTED_ALERTS and scrapes and float(scrapes[0]["value"][1]) >= 6:
                break
        yield {"collector": collector.url, "prometheus": prometheus, "firing": names}
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        collector.stop()
        app.state.engine.dispose()


def instant(prometheus: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def ranged(prometheus: str, expr: str) -> list[dict[str, Any]]:
    end = time.time()
    response = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": end - 30, "end": end, "step": "1s"},
        timeout=10,
    )
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def has_finite_value(result: list[dict[str, Any]]) -> bool:
    values = [s["value"] for s in result if "value" in s] + [v for s in result for v in s.get("values", [])]
    return any(math.isfinite(float(v[1])) for v in values)


def metric_options() -> list[tuple[str, str]]:
    board = json.loads((DASHBOARDS / "grafana" / "dashboards" / "run-overview.json").read_text())
    (variable,) = [v for v in board["templating"]["list"] if v["name"] == "metric"]
    return [tuple(part.strip() for part in item.split(" : ")) for item in variable["query"].split(",")]  # type: ignore[misc]


def interpolate(text: str, run: str, metric: tuple[str, str], layer: str) -> str:
    """Grafana's variable syntax, for the variables these dashboards use."""
    values = {
        "metric:text": metric[0],
        "metric": metric[1],
        "run": run,
        "layer": layer,
        "__rate_interval": RATE_INTERVAL,
    }
    text = re.sub(r"\$\{([A-Za-z_:]+)\}", lambda m: values[m.group(1)], text)
    return re.sub(r"\$([A-Za-z_]+)", lambda m: values[m.group(1)], text)


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(dashboard, where, query) of every panel target, annotation and variable of every dashboard."""
    for path in sorted((DASHBOARDS / "grafana" / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in panels(board):
            for target in panel.get("targets", []):
                yield path.name, f"panel {panel['title']!r} target {target['refId']}", target
        for annotation in board.get("annotations", {}).get("list", []):
            # An Infinity annotation wraps a panel-like target; a Prometheus one holds its expression itself.
            query = annotation["target"] if "url" in annotation.get("target", {}) else annotation
            yield path.name, f"annotation {annotation['name']!r}", {**query, "refId": "annotation"}
        for variable in board.get("templating", {}).get("list", []):
            if variable["type"] == "query":
                query = variable["query"]
                if isinstance(query, dict):  # an Infinity variable query wraps a panel-like target
                    assert query["queryType"] == "infinity"
                    target = query["infinityQuery"]
                else:
                    target = {"expr": query, "datasource": variable["datasource"]}
                yield path.name, f"variable ${variable['name']}", target


def run_prometheus_query(prometheus: str, target: dict[str, Any], expr: str) -> list[dict[str, Any]]:
    label_values = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", expr)
    if label_values:
        response = httpx.get(
            f"{prometheus}/api/v1/label/{label_values.group(2)}/values",
            params={"match[]": label_values.group(1)},
            timeout=10,
        )
        return [{"value": [0, "0"], "label": v} for v in response.json()["data"]]
    return instant(prometheus, expr) if target.get("instant") else ranged(prometheus, expr)


def run_collector_query(collector: str, target: dict[str, Any], run: str, metric: tuple[str, str], layer: str) -> Any:
    params = {p["key"]: interpolate(p["value"], run, metric, layer) for p in target["url_options"]["params"]}
    url = collector + interpolate(target["url"], run, metric, layer)
    response = httpx.get(url, params=params, timeout=30)
    assert response.status_code == 200, response.text
    return jsonata.Jsonata(target["root_selector"]).evaluate(response.json())


def run_layers(collector: str, run: str) -> list[str]:
    return [layer["name"] for layer in httpx.get(f"{collector}/api/v1/runs/{run}/layers", timeout=10).json()]


@pytest.mark.parametrize("run", [RUN, AGENT_RUN])
def test_every_dashboard_query_returns_data(stack: dict[str, Any], run: str) -> None:
    layers = run_layers(stack["collector"], run)
    assert layers == LAYERS if run == RUN else len(layers) == 3
    layer = layers[DEVIATING] if run == RUN else layers[0]
    checked = 0
    for dashboard, where, target in dashboard_queries():
        text = json.dumps(target)
        if run == AGENT_RUN and ("loss_shadow" in text or "shadow_gap" in text):
            continue  # no FP32 shadow model in the training run
        metrics = metric_options() if "metric" in text else [("output_rel_l2", "quantwatch_layer_output_rel_l2_ratio")]
        for metric in metrics:
            label = f"{dashboard}: {where} (run {run}, metric {metric[0]})"
            if target["datasource"]["uid"] == "quantwatch-prometheus":
                expr = interpolate(target["expr"], run, metric, layer)
                result = run_prometheus_query(stack["prometheus"], target, expr)
                if run == AGENT_RUN and "quantwatch_alert_" in expr and f'run="{AGENT_RUN}"' in expr:
                    # The agent sends its layers' formats: the shipped rules hold this healthy FP4 run to FP4's own
                    # baseline, so no rule breaches: no streak, no alert (the 5% bound used to fire on it).
                    assert result == [], f"{label}: {expr} returned {result}"
                    continue
                assert result, f"{label}: {expr} returned nothing"
                assert has_finite_value(result), f"{label}: {expr} returned no finite value: {result}"
            else:
                assert target["datasource"]["uid"] == "quantwatch-collector", label
                rows = run_collector_query(stack["collector"], target, run, metric, layer)
                assert isinstance(rows, list), f"{label}: {rows!r}"
                assert rows, f"{label}: no rows"
                check_rows(target, rows, layers, label)
            checked += 1
    assert checked >= 40


def check_rows(target: dict[str, Any], rows: list[dict[str, Any]], layers: list[str], label: str) -> None:
    if "/heatmap" in target["url"]:
        for row in rows:
            assert isinstance(row["step"], int)
            assert list(row)[1:] == [name for name in layers if name in row], f"{label}: layers out of model order"
        assert list(rows[-1])[1:] == layers, f"{label}: the newest bucket lacks layers"
        assert all(isinstance(v, (int, float)) for row in rows for v in row.values()), label
    elif "/series" in target["url"]:
        assert set(rows[0]) == {"step", "min", "mean", "max"}, label
        assert all(r["min"] <= r["mean"] <= r["max"] for r in rows), label
    elif "/actions" in target["url"]:
        assert [r["title"] for r in rows] == [f"keep_high_precision {r['title'].split()[-1]}" for r in rows], label
        assert all(isinstance(r["time"], float) and r["text"].startswith("after step 4: ") for r in rows), label
    elif "/layers" in target["url"]:
        assert [r["layer"] for r in rows] == layers, label
        if "format" in target["root_selector"]:  # both runs declare their layers' formats
            assert all(isinstance(r["format"], str) and r["format"] for r in rows), f"{label}: {rows}"


def test_every_rule_expression_returns_data(stack: dict[str, Any]) -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 10
    for rule in rules:
        result = instant(stack["prometheus"], rule["expr"])
        assert result, f"{rule.get('record') or rule.get('alert')}: {rule['expr']} returned nothing"
        assert has_finite_value(result), f"{rule['expr']}: {result}"
        if "record" in rule:
            assert instant(stack["prometheus"], rule["record"]), f"recording rule {rule['record']} has no series"


def test_default_rule_equivalents_fire_in_prometheus(stack: dict[str, Any]) -> None:
    firing = instant(stack["prometheus"], 'ALERTS{alertstate="firing"}')
    by_name = {s["metric"]["alertname"]: s["metric"] for s in firing}
    assert set(by_name) >= EXPECTED_ALERTS
    assert by_name["QuantWatchOutputDeviation"]["layer"] == LAYERS[DEVIATING]
    assert by_name["QuantWatchNonFinite"]["layer"] == LAYERS[NONFINITE]
    assert by_name["QuantWatchLossDivergence"]["run"] == RUN
    assert by_name["QuantWatchOutputDeviationLowBit"]["layer"] == LAYERS[LOW_BIT]
    assert by_name["QuantWatchUpdateDirection"]["layer"] == LAYERS[UPDATE_DRIFT]
    assert by_name["QuantWatchUpdateNoise"]["layer"] == LAYERS[UPDATE_DRIFT]
    assert by_name["QuantWatchRankWeightMismatch"]["layer"] == LAYERS[MISMATCH]
    # The collector's own evaluator agrees: the same three episodes fire there.
    episodes = httpx.get(f"{stack['collector']}/api/v1/alerts", params={"state": "firing"}, timeout=10).json()
    assert {e["rule"] for e in episodes} >= {
        "quantwatch_output_deviation",
        "quantwatch_nonfinite",
        "quantwatch_loss_divergence",
    }
