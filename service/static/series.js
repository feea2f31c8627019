// The layer history and loss panels.
import { annotationsFor } from "./actions.js";
import { api, ApiError } from "./api.js";
import { describeError } from "./banner.js";
import { isRatioMetric } from "./catalog.js";
import { drawChart, seriesFromBody } from "./chart.js";
import { $, setupCanvas, showOverlay } from "./dom.js";
import { ruleBounds } from "./rules.js";
import { state } from "./state.js";

// Each load counts up; an answer that arrives after a newer request started is dropped.
let seriesSeq = 0;
let lossSeq = 0;

export async function loadSeries() {
  const seq = ++seriesSeq;
  const canvas = $("series");
  $("series-title").textContent = state.layer ? `${state.layer} · ${state.metric}` : "Layer history";
  if (!state.layer || !state.metric) {
    canvas._chart = null;
    setupCanvas(canvas, Math.max(280, canvas.parentElement.clientWidth), 240);
    showOverlay("series-empty", "Click a heatmap cell to see that layer's history.");
    return;
  }
  let body;
  try {
    body = await api(`/runs/${encodeURIComponent(state.run)}/series`, {
      metric: state.metric,
      layer: state.layer,
      rank: state.rank,
      start: state.start,
      end: state.end,
      max_points: Math.max(50, Math.floor(canvas.parentElement.clientWidth)),
    });
  } catch (err) {
    if (seq !== seriesSeq) return;
    state.series = null;
    setupCanvas(canvas, Math.max(280, canvas.parentElement.clientWidth), 240);
    canvas._chart = null;
    showOverlay("series-empty", `Could not load the series: ${describeError(err)}`);
    return;
  }
  if (seq !== seriesSeq) return;
  state.series = seriesFromBody(body);
  drawSeries();
}

export function drawSeries() {
  const canvas = $("series");
  if (!state.series) return;
  const drawn = drawChart(canvas, {
    metric: state.metric,
    bounds: ruleBounds(state.metric, state.layer),
    marker: state.step,
    annotations: annotationsFor(state.layer),
    zeroBased: isRatioMetric(state.metric),
    lines: [{ name: state.metric, ...state.series, color: "#2f6fd6", band: true, bandColor: "rgba(47,111,214,0.18)" }],
  });
  showOverlay("series-empty", drawn ? null : "No points for this layer in this step range.");
  // Figures estimated from a subset of rows (the agent's shadow_rows) are marked "≈" in the tooltip; say so here.
  const note = $("series-note");
  const estimated = state.series.estimated.size;
  note.hidden = estimated === 0;
  note.textContent = estimated
    ? `≈ ${estimated} of ${state.series.steps.length} points estimated from a subset of rows (shadow_rows)`
    : "";
  canvas.dataset.estimated = JSON.stringify([...state.series.estimated]);
}

export async function loadLoss() {
  const seq = ++lossSeq;
  const canvas = $("loss");
  const params = {
    rank: state.rank,
    start: state.start,
    end: state.end,
    max_points: Math.max(50, Math.floor(canvas.parentElement.clientWidth)),
  };
  const get = (scalar) =>
    api(`/runs/${encodeURIComponent(state.run)}/series`, { scalar, ...params }).then(
      (body) => ({ body }),
      (err) => ({ err }),
    );
  const [loss, shadow] = await Promise.all([get("loss"), get("loss_shadow")]);
  if (seq !== lossSeq) return;
  const lines = [];
  if (loss.body) lines.push({ name: "loss", ...seriesFromBody(loss.body), color: "#2f6fd6" });
  if (shadow.body) lines.push({ name: "loss_shadow", ...seriesFromBody(shadow.body), color: "#7a8699", dash: [6, 4] });
  state.loss = lines;
  const failure = [loss.err, shadow.err].find((e) => e && !(e instanceof ApiError && e.status === 404));
  if (failure) {
    canvas._chart = null;
    setupCanvas(canvas, Math.max(280, canvas.parentElement.clientWidth), 240);
    showOverlay("loss-empty", `Could not load the loss: ${describeError(failure)}`);
    return;
  }
  drawLoss();
}

export function drawLoss() {
  const canvas = $("loss");
  const lines = state.loss || [];
  const drawn =
    lines.length > 0 &&
    drawChart(canvas, {
      metric: "loss",
      bounds: [],
      marker: state.step,
      annotations: annotationsFor(null),
      zeroBased: false,
      lines,
    });
  if (!drawn) {
    canvas._chart = null;
    setupCanvas(canvas, Math.max(280, canvas.parentElement.clientWidth), 240);
  }
  showOverlay("loss-empty", drawn ? null : "This run reports no loss.");
}
