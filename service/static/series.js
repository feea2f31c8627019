// The layer history and loss panels.
import { annotationsFor } from "./actions.js";
import { api, ApiError } from "./api.js";
import { describeError } from "./banner.js";
import { isRatioMetric } from "./catalog.js";
import { drawChart, seriesFromBody } from "./chart.js";
import { $, setupCanvas, showOverlay } from "./dom.js";
import { ALL, RANK_COLOURS, shownRanks } from "./ranks.js";
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
  const ranks = shownRanks();
  let bodies;
  try {
    const get = (rank) =>
      api(`/runs/${encodeURIComponent(state.run)}/series`, {
        metric: state.metric,
        layer: state.layer,
        rank,
        start: state.start,
        end: state.end,
        max_points: Math.max(50, Math.floor(canvas.parentElement.clientWidth)),
      });
    bodies = await Promise.all(ranks.map(get));
  } catch (err) {
    if (seq !== seriesSeq) return;
    state.series = null;
    setupCanvas(canvas, Math.max(280, canvas.parentElement.clientWidth), 240);
    canvas._chart = null;
    showOverlay("series-empty", `Could not load the series: ${describeError(err)}`);
    return;
  }
  if (seq !== seriesSeq) return;
  state.series = bodies.map((body, k) => ({ rank: ranks[k], ...seriesFromBody(body) }));
  drawSeries();
}

// One rank: its mean with the min/max band; every rank: a line per rank (colours in RANK_COLOURS).
function seriesLines() {
  if (state.rank !== ALL) {
    const band = { band: true, bandColor: "rgba(47,111,214,0.18)" };
    return [{ name: state.metric, ...state.series[0], color: RANK_COLOURS[0], ...band }];
  }
  return state.series.map((s, k) => ({ name: `rank ${s.rank}`, ...s, color: RANK_COLOURS[k % RANK_COLOURS.length] }));
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
    lines: seriesLines(),
  });
  showOverlay("series-empty", drawn ? null : "No points for this layer in this step range.");
  // Figures estimated from a subset of rows (the agent's shadow_rows) are marked "≈" in the tooltip; say so here.
  const note = $("series-note");
  const estimated = new Set(state.series.flatMap((s) => [...s.estimated]));
  const points = state.series.reduce((n, s) => n + s.steps.length, 0);
  note.hidden = estimated.size === 0;
  note.textContent = estimated.size
    ? `≈ ${estimated.size} of ${points} points estimated from a subset of rows (shadow_rows)`
    : "";
  canvas.dataset.estimated = JSON.stringify([...estimated]);
  const lines = seriesLines();
  canvas.dataset.lines = JSON.stringify(lines.map((line) => line.name));
  // Every rank drawn: which colour is which rank.
  const key = $("series-ranks");
  key.hidden = state.rank !== ALL;
  key.innerHTML = "";
  if (state.rank === ALL) {
    for (const line of lines) {
      const swatch = document.createElement("i");
      swatch.className = "line";
      swatch.style.borderColor = line.color;
      key.append(swatch, line.name);
    }
  }
}

export async function loadLoss() {
  const seq = ++lossSeq;
  const canvas = $("loss");
  const params = {
    rank: shownRanks()[0], // every rank shown: the loss of the lowest

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
  $("loss-rank").textContent = state.rank === ALL ? `(rank ${params.rank})` : "";
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
