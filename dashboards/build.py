"""Generate QuantWatch's Grafana dashboards as code (grafana-foundation-sdk) into dashboards/grafana/dashboards/.

    python dashboards/build.py          # write the JSON files
    python dashboards/build.py --check  # exit 1 when the committed JSON differs from what this script generates

Two data sources, provisioned with fixed uids (dashboards/grafana/provisioning/datasources/quantwatch.yml):
``quantwatch-prometheus`` (Prometheus: the live state, top-K worst layers, alert streaks, collector health) and
``quantwatch-collector`` (the Infinity JSON data source on the collector's REST API: full-resolution history, the
layer x step heatmaps). Heatmaps never come from Prometheus: it holds only the latest value of the worst layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, stat, table, timeseries, trend
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model
from grafana_foundation_sdk.models import prometheus as prom_model

from quantwatch.protocol import CATALOG, OVERVIEW_METRICS

OUT = Path(__file__).resolve().parent / "grafana" / "dashboards"

PROMETHEUS = model.DataSourceRef(type_val="prometheus", uid="quantwatch-prometheus")
COLLECTOR = model.DataSourceRef(type_val="yesoreyeram-infinity-datasource", uid="quantwatch-collector")

# Canonical metric (what the collector's API takes) : exported Prometheus family. Grafana's custom variable syntax
# "text : value" gives both: ${metric:text} in collector URLs, ${metric} in PromQL.
METRICS = {name: CATALOG[name].family for name in OVERVIEW_METRICS}

# JSONata for the Infinity backend parser. The heatmap endpoint answers {"layers", "steps", "values"[layer][step]};
# Grafana's pre-bucketed ("heatmap-rows") heatmap wants one row per step and one numeric field per layer, in model
# order, so the selector transposes it (a null cell leaves its field out of that row: Grafana draws no cell).
# The outer [...] keeps a one-row answer an array.
HEATMAP_ROWS = (
    "[$map(steps, function($s, $i) { $merge([{'step': $s}, "
    "$map($$.layers, function($l, $j) { {$l: ($row := $$.values[$j]; $row[$i])} })]) })]"
)
# The series endpoint answers {"steps", "min", "mean", "max"}: one row per (bucket of) step(s).
SERIES_ROWS = (
    "[$map(steps, function($s, $i) { {'step': $s, 'min': $$.min[$i], 'mean': $$.mean[$i], 'max': $$.max[$i]} })]"
)
# The layers endpoint answers a list of layers in model order; the variable takes their names.
LAYER_NAMES = "[$map($, function($l) { {'layer': $l.name} })]"
# ... and, for the worst-layers table, each layer's weight format (absent when the agent declares none).
LAYER_FORMATS = "[$map($, function($l) { {'layer': $l.name, 'format': $l.formats.weight} })]"
# The actions endpoint answers the agent's actions on the training job; an annotation wants a time, a title and a text.
ACTION_ROWS = (
    "[$map($, function($a) { {'time': $a.recorded_at, 'title': $a.action & ($a.layer ? ' ' & $a.layer : ''), "
    "'text': 'after step ' & $string($a.step) & ': ' & $a.detail} })]"
)
ACTION_COLUMNS = [
    {"selector": "time", "text": "time", "type": "timestamp_epoch_s"},
    {"selector": "title", "text": "title", "type": "string"},
    {"selector": "text", "text": "text", "type": "string"},
]
# Grafana's built-in data source of a panel whose targets use different ones.
MIXED = model.DataSourceRef(type_val="datasource", uid="-- Mixed --")


class Infinity(cogvariants.Dataquery, cogbuilder.Builder[cogvariants.Dataquery]):
    """A query of the Infinity data source (yesoreyeram-infinity-datasource) against the collector's REST API; its
    own builder, so panels take it like any SDK query."""

    def __init__(
        self,
        ref_id: str,
        path: str,
        params: dict[str, str],
        root_selector: str,
        columns: list[dict[str, str]] | None = None,
    ) -> None:
        self.ref_id = ref_id
        self.path = path
        self.params = params
        self.root_selector = root_selector
        self.columns = columns or []

    def build(self) -> cogvariants.Dataquery:
        """The query."""
        return self

    def to_json(self) -> dict[str, object]:
        """The panel target as Grafana stores it."""
        return {
            "refId": self.ref_id,
            "datasource": COLLECTOR.to_json(),
            "type": "json",
            "source": "url",
            "parser": "backend",
            "format": "table",
            "url": self.path,
            "url_options": {
                "method": "GET",
                "params": [{"key": key, "value": value} for key, value in self.params.items()],
            },
            "root_selector": self.root_selector,
            "columns": self.columns,
        }


def promql(ref_id: str, expr: str, legend: str = "__auto", *, instant: bool = False) -> prom.Dataquery:
    """A Prometheus target on the provisioned Prometheus."""
    query = prom.Dataquery().ref_id(ref_id).expr(expr).legend_format(legend).datasource(PROMETHEUS)
    return query.instant().format(prom_model.PromQueryFormat.TABLE) if instant else query.range()


def run_variable() -> dash.QueryVariable:
    """$run: the runs Prometheus sees (only runs active within the exposition TTL)."""
    return (
        dash.QueryVariable("run")
        .label("Run")
        .datasource(PROMETHEUS)
        .query("label_values(quantwatch_run_last_step, run)")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )


def metric_variable(*, multi: bool) -> dash.CustomVariable:
    """$metric: canonical metric names (text) mapped to their Prometheus families (value)."""
    variable = (
        dash.CustomVariable("metric")
        .label("Metric")
        .values(", ".join(f"{name} : {family}" for name, family in METRICS.items()))
        .current(
            model.VariableOption(selected=True, text="output_rel_l2", value="quantwatch_layer_output_rel_l2_ratio")
        )
    )
    return variable.multi(True).include_all(True) if multi else variable


def layer_variable() -> dash.QueryVariable:
    """$layer: every layer of the run, in model order, from the collector (Prometheus holds only the worst K)."""
    return (
        dash.QueryVariable("layer")
        .label("Layer")
        .datasource(COLLECTOR)
        .query(
            {
                "queryType": "infinity",
                "query": "",
                "infinityQuery": Infinity("variable", "/api/v1/runs/${run}/layers", {}, LAYER_NAMES).build().to_json(),
            }
        )
        .refresh(model.VariableRefresh.ON_DASHBOARD_LOAD)
    )


def layer_heatmap() -> heatmap.Panel:
    """Layer x step heatmap of ${metric} over the run's whole history, pre-bucketed by the collector."""
    return (
        heatmap.Panel()
        .title("${metric:text}: layer × step (collector history)")
        .description(
            "Full-resolution history from the collector, max per step bucket, layers in model order (top row = "
            "first layer). Zero cells are drawn, not hidden."
        )
        .datasource(COLLECTOR)
        .with_target(
            Infinity(
                "heatmap",
                "/api/v1/runs/${run}/heatmap",
                {"metric": "${metric:text}", "max_steps": "500", "agg": "max"},
                HEATMAP_ROWS,
            )
        )
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN).value("${metric:text}"))
        .filter_values(heatmap.FilterValueRange().le(-1e300))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_model.HeatmapColorMode.SCHEME)
            .scheme("Turbo")
            .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
        )
        .y_axis(heatmap.YAxisConfig().reverse(True).axis_label("layer"))
        .cell_gap(0)
        .mode(common.TooltipDisplayMode.SINGLE)
        .show_color_scale(True)
        .height(12)
        .span(16)
    )


def worst_layers_table() -> table.Panel:
    """The worst layers of ${metric} now: exactly what the exposition's top-K cap exports, each with its weight's
    number format from the collector (the exposition has no format label: the layers endpoint is joined on layer)."""
    return (
        table.Panel()
        .title("${metric:text}: worst layers now")
        .description(
            "Latest value of the worst layers (top-K per run and metric; for cosines and SQNR the lowest), with the "
            "number format of each layer's weight as the agent declares it."
        )
        .datasource(MIXED)
        .with_target(promql("worst", '${metric}{run="$run"}', instant=True))
        .with_target(Infinity("formats", "/api/v1/runs/${run}/layers", {}, LAYER_FORMATS))
        # Inner: only the worst layers stay (the layers endpoint lists every layer, its format or not).
        .with_transformation(
            model.DataTransformerConfig(id_val="joinByField", options={"byField": "layer", "mode": "inner"})
        )
        .with_transformation(
            model.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True},
                    "renameByName": {"Value": "${metric:text}"},
                },
            )
        )
        .height(12)
        .span(8)
    )


def actions_annotation() -> dash.AnnotationQuery:
    """The agent's actions on the run's training job (``qw.actions``), at the time the collector stored each."""
    return (
        dash.AnnotationQuery()
        .name("QuantWatch actions")
        .datasource(COLLECTOR)
        .enable(True)
        .icon_color("green")
        .target(Infinity("actions", "/api/v1/actions", {"run": "${run}"}, ACTION_ROWS, ACTION_COLUMNS))  # type: ignore[arg-type]
    )


def run_overview() -> dash.Dashboard:
    """Run overview: heatmaps per metric, worst layers, loss vs the FP32 shadow, alerts, throughput and memory."""
    metric_row = (
        dash.Row("${metric:text}").repeat("metric").with_panel(layer_heatmap()).with_panel(worst_layers_table())
    )
    return (
        dash.Dashboard("QuantWatch · Run overview")
        .uid("quantwatch-run-overview")
        .tags(["quantwatch"])
        .editable()
        .refresh("10s")
        .time("now-6h", "now")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .with_variable(run_variable())
        .with_variable(metric_variable(multi=True))
        .annotation(
            dash.AnnotationQuery()
            .name("QuantWatch alerts")
            .datasource(PROMETHEUS)
            .enable(True)
            .icon_color("red")
            .target(dash.AnnotationTarget().limit(100).match_any(False).tags([]).type("dashboard"))
            .expr('quantwatch_alert_state{run="$run", state="firing"}')
        )
        .annotation(actions_annotation())
        .with_row(dash.Row("Run"))
        .with_panel(
            timeseries.Panel()
            .title("Loss vs FP32 shadow")
            .datasource(PROMETHEUS)
            .with_target(promql("loss", 'quantwatch_run_loss{run="$run"}', "loss rank {{rank}}"))
            .with_target(promql("shadow", 'quantwatch_run_loss_shadow{run="$run"}', "FP32 shadow rank {{rank}}"))
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .title("Loss gap to the shadow")
            .description("loss / loss_shadow − 1; the default rule alerts above 5% for 3 consecutive steps.")
            .datasource(PROMETHEUS)
            .with_target(promql("gap", 'run_rank:quantwatch_run_loss_shadow_gap:ratio{run="$run"}', "rank {{rank}}"))
            .unit("percentunit")
            .height(8)
            .span(8)
        )
        .with_panel(
            table.Panel()
            .title("Alert streaks")
            .description("Consecutive breaching steps per rule and layer, as the collector counts them.")
            .datasource(PROMETHEUS)
            .with_target(promql("streaks", 'quantwatch_alert_streak_steps{run="$run"}', instant=True))
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .title("Throughput")
            .datasource(PROMETHEUS)
            .with_target(promql("tps", 'quantwatch_run_tokens_per_second{run="$run"}', "tokens/s rank {{rank}}"))
            .unit("short")
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .title("Step time")
            .datasource(PROMETHEUS)
            .with_target(promql("step", 'quantwatch_run_step_seconds{run="$run"}', "rank {{rank}}"))
            .unit("s")
            .height(8)
            .span(8)
        )
        .with_panel(
            timeseries.Panel()
            .title("Device memory")
            .datasource(PROMETHEUS)
            .with_target(promql("mem", 'quantwatch_run_device_memory_bytes{run="$run"}', "rank {{rank}}"))
            .unit("bytes")
            .height(8)
            .span(8)
        )
        .with_row(metric_row)
    )


def layer_drilldown() -> dash.Dashboard:
    """Layer drill-down: every metric of one layer over steps, with min/max bands, from the collector's history."""
    history = (
        trend.Panel()
        .title("${metric:text} of ${layer}")
        .description("Mean per step bucket with the min–max band (exact when a bucket holds one step).")
        .datasource(COLLECTOR)
        .with_target(
            Infinity(
                "series",
                "/api/v1/runs/${run}/series",
                {"metric": "${metric:text}", "layer": "${layer}", "max_points": "500"},
                SERIES_ROWS,
            )
        )
        .x_field("step")
        .override_by_name("max", [model.DynamicConfigValue(id_val="custom.fillBelowTo", value="min")])
        .override_by_name("min", [model.DynamicConfigValue(id_val="custom.lineWidth", value=0)])
        .override_by_name("max", [model.DynamicConfigValue(id_val="custom.lineWidth", value=0)])
        .repeat("metric")
        .repeat_direction("h")
        .max_per_row(2)
        .height(8)
        .span(12)
    )
    return (
        dash.Dashboard("QuantWatch · Layer drill-down")
        .uid("quantwatch-layer-drilldown")
        .tags(["quantwatch"])
        .editable()
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(run_variable())
        .with_variable(layer_variable())
        .with_variable(metric_variable(multi=True))
        .with_panel(
            table.Panel()
            .title("${layer}: latest values (when among the worst K)")
            .datasource(PROMETHEUS)
            .with_target(
                promql("latest", '{__name__=~"quantwatch_layer_.+", run="$run", layer="$layer"}', instant=True)
            )
            .height(6)
            .span(24)
        )
        .with_panel(history)
    )


def collector_health() -> dash.Dashboard:
    """Collector health: ingest rate and latency, outcomes, series left out by the cap, alert deliveries."""
    return (
        dash.Dashboard("QuantWatch · Collector health")
        .uid("quantwatch-collector-health")
        .tags(["quantwatch"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .with_panel(
            stat.Panel()
            .title("Collectors up")
            .datasource(PROMETHEUS)
            .with_target(promql("up", 'sum(up{job="quantwatch"})'))
            .height(4)
            .span(6)
        )
        .with_panel(
            stat.Panel()
            .title("Runs exported")
            .datasource(PROMETHEUS)
            .with_target(promql("runs", "count(count by (run) (quantwatch_run_last_step))"))
            .height(4)
            .span(6)
        )
        .with_panel(
            stat.Panel()
            .title("Layer series left out by the cap")
            .datasource(PROMETHEUS)
            .with_target(promql("omitted", "sum(quantwatch_exposition_layer_series_omitted)"))
            .height(4)
            .span(6)
        )
        .with_panel(
            stat.Panel()
            .title("Build")
            .datasource(PROMETHEUS)
            .with_target(promql("build", "quantwatch_build_info", "{{version}}", instant=True))
            .height(4)
            .span(6)
        )
        .with_panel(
            timeseries.Panel()
            .title("Ingest rate")
            .datasource(PROMETHEUS)
            .with_target(promql("points", "sum(rate(quantwatch_ingest_points_total[$__rate_interval]))", "points/s"))
            .unit("short")
            .height(8)
            .span(12)
        )
        .with_panel(
            timeseries.Panel()
            .title("Ingest requests by outcome")
            .datasource(PROMETHEUS)
            .with_target(
                promql(
                    "outcomes",
                    "sum by (outcome) (rate(quantwatch_ingest_requests_total[$__rate_interval]))",
                    "{{outcome}}",
                )
            )
            .unit("reqps")
            .height(8)
            .span(12)
        )
        .with_panel(
            timeseries.Panel()
            .title("Ingest latency")
            .datasource(PROMETHEUS)
            .with_target(
                promql(
                    "p50",
                    "histogram_quantile(0.5, sum by (le) "
                    "(rate(quantwatch_ingest_request_duration_seconds_bucket[$__rate_interval])))",
                    "p50",
                )
            )
            .with_target(
                promql(
                    "p99",
                    "histogram_quantile(0.99, sum by (le) "
                    "(rate(quantwatch_ingest_request_duration_seconds_bucket[$__rate_interval])))",
                    "p99",
                )
            )
            .unit("s")
            .height(8)
            .span(12)
        )
        .with_panel(
            timeseries.Panel()
            .title("Dropped series")
            .description("Layer values left out by the top-K cap, and runs expired after the TTL.")
            .datasource(PROMETHEUS)
            .with_target(
                promql("capped", "rate(quantwatch_exposition_layer_values_omitted_total[$__rate_interval])", "capped/s")
            )
            .with_target(promql("expired", "quantwatch_exposition_runs_expired_total", "runs expired"))
            .height(8)
            .span(12)
        )
        .with_panel(
            timeseries.Panel()
            .title("Alert deliveries by status")
            .description(
                "The collector's outbox: pending and failed notifications need attention; failed ones gave up."
            )
            .datasource(PROMETHEUS)
            .with_target(promql("deliveries", "sum by (status) (quantwatch_alert_deliveries)", "{{status}}"))
            .height(8)
            .span(12)
        )
        .with_panel(
            timeseries.Panel()
            .title("Alert streaks (max per rule)")
            .datasource(PROMETHEUS)
            .with_target(promql("streaks", "max by (rule) (quantwatch_alert_streak_steps)", "{{rule}}"))
            .height(8)
            .span(12)
        )
    )


def dashboards() -> dict[str, dash.Dashboard]:
    """Every dashboard, by the file name it is written to."""
    return {
        "run-overview.json": run_overview(),
        "layer-drilldown.json": layer_drilldown(),
        "collector-health.json": collector_health(),
    }


def render(board: dash.Dashboard) -> str:
    """The dashboard JSON exactly as committed: sorted keys, two-space indent, trailing newline."""
    data: Any = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with --check report which committed files are stale."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the committed JSON is not what this generates")
    args = parser.parse_args(argv)
    stale = []
    OUT.mkdir(parents=True, exist_ok=True)
    for name, board in dashboards().items():
        path = OUT / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run python dashboards/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
