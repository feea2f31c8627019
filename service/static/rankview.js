// The layers × ranks view: one metric at one step, a column per rank, each cell coloured against its layer's rule
// bound as the heatmap colours it; a rank that did not measure the step is hatched (not measured). Layers whose
// weights differ across ranks (GET /runs/{run}/ranks) are listed as links to their step and outlined in the grid.
import { api } from "./api.js";
import { describeError } from "./banner.js";
import { makeScale } from "./colour.js";
import { $ } from "./dom.js";
import { formatTick, formatValue, toNumber } from "./format.js";
import { drawLegend } from "./legend.js";
import { runRanks } from "./ranks.js";
import { rowBounds } from "./rules.js";
import { hashFor, setHash, state } from "./state.js";

const MISMATCH_METRIC = "rank_weight_mismatch";
const MAX_LISTED = 12;

// Each load counts up; an answer that arrives after a newer request started is dropped.
let rankViewSeq = 0;

export async function loadRankView() {
  $("ranks-card").hidden = runRanks().length < 2;
  if ($("ranks-card").hidden) return;
  const seq = ++rankViewSeq;
  $("rank-step").value = state.step ?? "";
  const run = encodeURIComponent(state.run);
  const wanted = state.metric && state.step !== null;
  const [answer, mismatches] = await Promise.all([
    wanted ? api(`/runs/${run}/steps/${state.step}`, { metric: state.metric }).catch((err) => ({ err })) : null,
    api(`/runs/${run}/ranks`).then((body) => body.mismatches || [], () => []),
  ]);
  if (seq !== rankViewSeq) return;
  state.rankView = answer && !answer.err ? { ...answer, mismatches } : null;
  renderMismatches(mismatches);
  let message = null;
  if (!wanted) message = "Click a heatmap column, or enter a step, to compare the ranks at that step.";
  else if (answer.err) message = `Could not load the step: ${describeError(answer.err)}`;
  else if (answer.step === null) message = `No rank measured ${state.metric} at or after step ${state.step}.`;
  $("ranks-empty").textContent = message || "";
  $("ranks-empty").hidden = message === null;
  drawRankView();
}

function renderMismatches(mismatches) {
  const box = $("ranks-mismatches");
  box.innerHTML = "";
  box.hidden = mismatches.length === 0;
  if (box.hidden) return;
  box.append("Weights differ across ranks: ");
  for (const m of mismatches.slice(0, MAX_LISTED)) {
    const a = document.createElement("a");
    a.href = "#" + hashFor({ metric: MISMATCH_METRIC, step: m.step, layer: m.layer });
    a.textContent = `step ${m.step} ${m.layer} (rank ${m.ranks.join(", ")} ≠ rank ${m.reference_rank})`;
    box.append(a, " ");
  }
  if (mismatches.length > MAX_LISTED) box.append(`and ${mismatches.length - MAX_LISTED} more`);
}

function cell(view, value, raw, layer, rank, style, scale) {
  const td = document.createElement("td");
  td.dataset.value = raw === null ? "null" : String(raw);
  td.dataset.rank = String(rank);
  td.title = `${layer} · rank ${rank}: ${formatValue(value, view.metric)}`;
  if (value === null) {
    td.className = "nodata";
  } else if (!Number.isFinite(value)) {
    td.className = "nonfinite";
    td.textContent = formatValue(value, "");
  } else {
    const rgb = [0, 0, 0];
    scale.fill(value, rgb, 0, style);
    td.style.background = `rgb(${rgb.join(",")})`;
    td.style.color = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140 ? "#fff" : "#1d2433";
    td.textContent = formatTick(value);
  }
  const differs = view.mismatches.some((m) => m.step === view.step && m.layer === layer && m.ranks.includes(rank));
  if (differs) td.classList.add("differs");
  return td;
}

export function drawRankView() {
  const view = state.rankView;
  const table = $("ranks-table");
  table.innerHTML = "";
  $("ranks-info").textContent = "";
  if (!view || view.step === null) return;
  const { layers, ranks, metric } = view;
  const values = view.values.map((row) => row.map(toNumber));
  const { bounds, legend, unwatched } = rowBounds(metric, layers);
  const scale = makeScale(metric, values.flat(), legend.map((entry) => entry.bound));
  const head = document.createElement("tr");
  head.append(Object.assign(document.createElement("th"), { textContent: "layer" }));
  for (const rank of ranks) head.append(Object.assign(document.createElement("th"), { textContent: `rank ${rank}` }));
  table.append(head);
  layers.forEach((layer, r) => {
    const tr = document.createElement("tr");
    tr.dataset.layer = layer;
    if (layer === state.layer) tr.className = "selected";
    tr.append(Object.assign(document.createElement("th"), { textContent: layer, title: layer }));
    const style = scale.style(bounds[r]);
    ranks.forEach((rank, k) => tr.append(cell(view, values[r][k], view.values[r][k], layer, rank, style, scale)));
    table.append(tr);
  });
  const moved = view.step !== state.step ? ` (the first at or after ${state.step} that a rank measured)` : "";
  $("ranks-info").textContent = `${metric} at step ${view.step}${moved} · ${layers.length} layers × ${ranks.length} ranks`;
  table.dataset.step = String(view.step);
  drawLegend("ranks-legend", scale, metric, legend, unwatched);
}

export function installRankViewEvents() {
  $("rank-step").addEventListener("change", (e) => {
    const step = Number(e.target.value);
    if (e.target.value !== "" && Number.isInteger(step) && step >= 0) setHash({ step });
  });
  // A cell selects its layer and rank for the heatmap and the layer history.
  $("ranks-table").addEventListener("click", (e) => {
    const td = e.target.closest("td");
    if (td) setHash({ layer: td.parentElement.dataset.layer, rank: Number(td.dataset.rank) });
  });
}
