// The layers × steps heatmap: loading, colouring, drawing, hover and brushing.
import { pick } from "./api.js";
import { describeError } from "./banner.js";
import { lowerIsWorse } from "./catalog.js";
import { HATCH_DARK, HATCH_LIGHT, makeScale, NONFINITE } from "./colour.js";
import { $, ellipsizeLeft, placeTooltip, setupCanvas, showOverlay } from "./dom.js";
import { formatBound, formatLabel, formatsText, formatValue, niceTicks, toNumber } from "./format.js";
import { drawLegend } from "./legend.js";
import { heatmapForRanks, runRanks } from "./ranks.js";
import { breaches, rowBounds } from "./rules.js";
import { loadSeries } from "./series.js";
import { setHash, state } from "./state.js";

const MAX_HEATMAP_COLUMNS = 500;

// What a bucket of several steps shows: the chosen aggregate, or for "worst" the one that keeps a bad step visible.
function bucketAggregate(metric) {
  if (state.agg !== "worst") return state.agg;
  return lowerIsWorse(metric) ? "min" : "max";
}

// Heatmap: one ImageData fill per draw (fast for 512 layers × 500 columns), null cells hatched, non-finite magenta.

const HM = { left: 0, top: 6, right: 10, bottom: 24 };

function heatmapGeometry(rows) {
  const wrap = $("heatmap-wrap");
  const width = Math.max(320, wrap.clientWidth);
  const rowHeight = Math.max(1.2, Math.min(18, 640 / Math.max(1, rows)));
  const plotH = Math.max(36, Math.round(rows * rowHeight));
  return { width, plotH, height: HM.top + plotH + HM.bottom };
}

function heatmapColumns() {
  const wrap = $("heatmap-wrap");
  return Math.max(20, Math.min(MAX_HEATMAP_COLUMNS, Math.floor(wrap.clientWidth - 200)));
}

// The columns a heatmap draws: those where at least one layer was measured. A run sampled every 10 steps answers
// with a column per step while nothing was measured at 9 of 10: those columns are not holes, they were never
// expected, so they are left out; a cell is hatched only where its layer is missing from a column others measured.
function measuredColumns(raw, rows, cols) {
  const keep = [];
  for (let c = 0; c < cols; c++) {
    for (let r = 0; r < rows; r++) {
      const v = raw[r] ? raw[r][c] : undefined;
      if (v !== null && v !== undefined) {
        keep.push(c);
        break;
      }
    }
  }
  return keep;
}

function prepareHeatmap(body, metric) {
  const layers = body.layers || [];
  const rows = layers.length;
  const keep = measuredColumns(body.values || [], rows, (body.steps || []).length);
  const steps = keep.map((c) => body.steps[c]);
  const raw = layers.map((_, r) => keep.map((c) => ((body.values && body.values[r]) || [])[c] ?? null));
  const cols = steps.length;
  const values = new Array(rows * cols);
  const flat = [];
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const v = toNumber(raw[r][c]);
      values[r * cols + c] = v;
      if (v !== null) flat.push(v);
    }
  }
  const { bounds, legend, unwatched } = rowBounds(metric, layers);
  const scale = makeScale(metric, flat, legend.map((entry) => entry.bound));
  // Pre-computed RGB per cell; kind 0 = value, 1 = not measured, 2 = non-finite.
  const rgb = new Uint8ClampedArray(rows * cols * 3);
  const kind = new Uint8Array(rows * cols);
  for (let r = 0; r < rows; r++) {
    const style = scale.style(bounds[r]);
    for (let i = r * cols; i < (r + 1) * cols; i++) {
      const v = values[i];
      if (v === null) {
        kind[i] = 1;
      } else if (Number.isFinite(v)) {
        scale.fill(v, rgb, i * 3, style);
      } else {
        kind[i] = 2;
        rgb[i * 3] = NONFINITE[0];
        rgb[i * 3 + 1] = NONFINITE[1];
        rgb[i * 3 + 2] = NONFINITE[2];
      }
    }
  }
  const formats = layers.map((layer) => state.formats.get(layer) || null);
  // With every rank shown: the rank each cell's value came from (see ranks.js).
  const worstRank = body.worst_rank ? layers.map((_, r) => keep.map((c) => body.worst_rank[r]?.[c] ?? null)) : null;
  return { layers, steps, rows, cols, raw, values, scale, bounds, formats, legend, unwatched, rgb, kind, metric, worstRank };
}

export function drawHeatmap() {
  const hm = state.heatmap;
  const canvas = $("heatmap");
  if (!hm || hm.rows === 0 || hm.cols === 0) {
    setupCanvas(canvas, Math.max(320, $("heatmap-wrap").clientWidth), 120).ctx.clearRect(0, 0, 4000, 120);
    delete canvas.dataset.rows;
    return;
  }
  const geo = heatmapGeometry(hm.rows);
  const { ctx, dpr } = setupCanvas(canvas, geo.width, geo.height);
  ctx.clearRect(0, 0, geo.width, geo.height);

  // Left gutter sized to the layer names (ellipsized from the left: the end of a qualified name says the most), then
  // one for each layer's format (its weight's; the tooltip has all three kinds) and one for the bound each row is
  // coloured against, so that an nvfp4 row held to 25% says so next to an fp8_e4m3 one held to 5%.
  ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
  let labelWidth = 0;
  for (const name of hm.layers) labelWidth = Math.max(labelWidth, ctx.measureText(name).width);
  const widest = (texts) => texts.reduce((w, text) => Math.max(w, ctx.measureText(text).width), 0);
  const formatTexts = hm.formats.map(formatLabel);
  const boundTexts = hm.bounds.map((b) => (b ? formatBound(b, hm.metric) : ""));
  const formatWidth = widest(formatTexts);
  const boundWidth = widest(boundTexts);
  const nameGutter = Math.round(Math.min(240, Math.max(60, labelWidth + 12)));
  const boundsAt = nameGutter + (formatWidth > 0 ? Math.round(formatWidth + 10) : 0);
  const left = boundsAt + (boundWidth > 0 ? Math.round(boundWidth + 10) : 0);
  const plotW = geo.width - left - HM.right;
  const plotH = geo.plotH;
  hm.plot = { x: left, y: HM.top, w: plotW, h: plotH };

  const pxW = Math.max(1, Math.round(plotW * dpr));
  const pxH = Math.max(1, Math.round(plotH * dpr));
  const image = ctx.createImageData(pxW, pxH);
  const data = image.data;
  const colOf = new Int32Array(pxW);
  for (let x = 0; x < pxW; x++) colOf[x] = Math.min(hm.cols - 1, Math.floor((x * hm.cols) / pxW));
  const hatchPeriod = Math.max(4, Math.round(6 * dpr));
  for (let y = 0; y < pxH; y++) {
    const r = Math.min(hm.rows - 1, Math.floor((y * hm.rows) / pxH));
    const base = r * hm.cols;
    let o = y * pxW * 4;
    for (let x = 0; x < pxW; x++, o += 4) {
      const i = base + colOf[x];
      if (hm.kind[i] === 1) {
        const c = (x + y) % hatchPeriod < hatchPeriod / 2 ? HATCH_DARK : HATCH_LIGHT;
        data[o] = c[0];
        data[o + 1] = c[1];
        data[o + 2] = c[2];
      } else {
        data[o] = hm.rgb[i * 3];
        data[o + 1] = hm.rgb[i * 3 + 1];
        data[o + 2] = hm.rgb[i * 3 + 2];
      }
      data[o + 3] = 255;
    }
  }
  ctx.putImageData(image, Math.round(left * dpr), Math.round(HM.top * dpr));

  // Layer labels: all of them when rows are tall enough, otherwise every k-th.
  const rowH = plotH / hm.rows;
  const every = rowH >= 11 ? 1 : Math.ceil(12 / rowH);
  ctx.fillStyle = "#344054";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let r = 0; r < hm.rows; r += every) {
    const y = HM.top + (r + 0.5) * rowH;
    ctx.fillStyle = "#344054";
    ctx.fillText(ellipsizeLeft(ctx, hm.layers[r], nameGutter - 8), nameGutter - 6, y);
    ctx.fillStyle = "#475467";
    if (formatTexts[r]) ctx.fillText(formatTexts[r], boundsAt - 6, y);
    ctx.fillStyle = "#667085";
    if (boundTexts[r]) ctx.fillText(boundTexts[r], left - 4, y);
  }

  // Step axis: round step numbers, placed inside the column (bucket) that holds them.
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "top";
  ctx.fillStyle = "#475467";
  ctx.strokeStyle = "#98a2b3";
  const colW = plotW / hm.cols;
  const lastStep = stepRangeOfColumn(hm, hm.cols - 1)[1];
  const integerTicks = niceTicks(hm.steps[0], lastStep, Math.max(1, Math.floor(plotW / 90))).filter(
    (t) => Number.isInteger(t),
  );
  for (const t of integerTicks) {
    const c = columnOfStep(hm, t);
    if (c < 0) continue;
    const [first, last] = stepRangeOfColumn(hm, c);
    if (t > last) continue; // a step no column holds (not sampled)
    const x = left + (c + (t - first + 0.5) / (last - first + 1)) * colW;
    ctx.beginPath();
    ctx.moveTo(x, HM.top + plotH);
    ctx.lineTo(x, HM.top + plotH + 4);
    ctx.stroke();
    ctx.textAlign = "center";
    ctx.fillText(String(t), Math.min(Math.max(x, left + 12), left + plotW - 12), HM.top + plotH + 6);
  }

  // The selected cell (layer and step), outlined.
  const r = hm.layers.indexOf(state.layer);
  const c = columnOfStep(hm, state.step);
  if (r >= 0 && c >= 0) {
    ctx.strokeStyle = "#111";
    ctx.lineWidth = 1.5;
    ctx.strokeRect(left + c * colW - 1, HM.top + r * rowH - 1, Math.max(colW, 2) + 2, Math.max(rowH, 2) + 2);
  }

  // Geometry for tests and tools: where each cell is, in CSS pixels relative to the canvas.
  canvas.dataset.rows = String(hm.rows);
  canvas.dataset.cols = String(hm.cols);
  canvas.dataset.plot = JSON.stringify(hm.plot);
  canvas.dataset.rowBounds = JSON.stringify(boundTexts);
  canvas.dataset.rowFormats = JSON.stringify(formatTexts);
  drawLegend("legend", hm.scale, hm.metric, hm.legend, hm.unwatched);
}

function columnOfStep(hm, step) {
  if (step === null || !hm || hm.cols === 0) return -1;
  let c = -1;
  for (let i = 0; i < hm.cols; i++) {
    if (hm.steps[i] <= step) c = i;
    else break;
  }
  return c;
}

function heatmapCellAt(event) {
  const hm = state.heatmap;
  if (!hm || !hm.plot) return null;
  const rect = $("heatmap").getBoundingClientRect();
  const x = event.clientX - rect.left - hm.plot.x;
  const y = event.clientY - rect.top - hm.plot.y;
  if (x < 0 || y < 0 || x >= hm.plot.w || y >= hm.plot.h) return null;
  const c = Math.min(hm.cols - 1, Math.floor((x * hm.cols) / hm.plot.w));
  const r = Math.min(hm.rows - 1, Math.floor((y * hm.rows) / hm.plot.h));
  return { r, c, x: x + hm.plot.x, y: y + hm.plot.y };
}

// Columns are aligned buckets of `bucket_steps` steps; `steps[c]` is the first step of bucket c (clipped to start).
function stepRangeOfColumn(hm, c) {
  const first = hm.steps[c];
  const bucketStart = first - (first % hm.bucketSteps);
  let last = bucketStart + hm.bucketSteps - 1;
  if (hm.lastStep !== null && hm.lastStep !== undefined) last = Math.max(first, Math.min(last, hm.lastStep));
  return [first, last];
}

function showHeatmapTooltip(cell) {
  const hm = state.heatmap;
  const tooltip = $("heatmap-tooltip");
  const rawRow = hm.raw[cell.r] || [];
  const raw = rawRow[cell.c] === undefined ? null : rawRow[cell.c];
  const value = hm.values[cell.r * hm.cols + cell.c];
  const [first, last] = stepRangeOfColumn(hm, cell.c);
  const stepText = hm.exact || first === last ? `step ${first}` : `steps ${first}–${last} (${hm.agg})`;
  tooltip.dataset.layer = hm.layers[cell.r];
  tooltip.dataset.step = String(first);
  tooltip.dataset.value = raw === null ? "null" : String(raw);
  tooltip.innerHTML = "";
  const line = (k, v) => {
    const div = document.createElement("div");
    const key = document.createElement("span");
    key.className = "k";
    key.textContent = k + " ";
    const val = document.createElement("b");
    val.textContent = v;
    div.append(key, val);
    tooltip.append(div);
  };
  line("layer", hm.layers[cell.r]);
  if (hm.formats[cell.r]) line("formats", formatsText(hm.formats[cell.r]));
  line(hm.exact || first === last ? "step" : "steps", stepText.replace(/^steps? /, ""));
  line(hm.metric, formatValue(value, hm.metric));
  const rank = hm.worstRank ? hm.worstRank[cell.r][cell.c] : null;
  tooltip.dataset.rank = rank === null ? "" : String(rank);
  if (rank !== null) line("rank", `${rank} (the worst of ${runRanks().length})`);
  const bound = hm.bounds[cell.r];
  if (bound) {
    const past = value !== null && breaches(bound, value);
    line("rule", `${bound.rules.join(", ")} ${formatBound(bound, hm.metric)}${past ? " (past it)" : ""}`);
  }
  placeTooltip(tooltip, $("heatmap-wrap"), cell.x, cell.y);
}

export function installHeatmapEvents() {
  const canvas = $("heatmap");
  const brush = $("heatmap-brush");
  let dragFrom = null;
  canvas.addEventListener("mousemove", (event) => {
    const cell = heatmapCellAt(event);
    if (!cell) {
      $("heatmap-tooltip").hidden = true;
    } else {
      showHeatmapTooltip(cell);
    }
    if (dragFrom && cell) {
      const hm = state.heatmap;
      const x0 = Math.min(dragFrom.x, cell.x);
      const x1 = Math.max(dragFrom.x, cell.x);
      if (x1 - x0 > 4) {
        brush.hidden = false;
        brush.style.left = `${x0}px`;
        brush.style.width = `${x1 - x0}px`;
        brush.style.top = `${hm.plot.y}px`;
        brush.style.height = `${hm.plot.h}px`;
      }
    }
  });
  canvas.addEventListener("mouseleave", () => {
    $("heatmap-tooltip").hidden = true;
  });
  canvas.addEventListener("mousedown", (event) => {
    const cell = heatmapCellAt(event);
    if (cell) dragFrom = cell;
    event.preventDefault();
  });
  window.addEventListener("mouseup", (event) => {
    if (!dragFrom) return;
    const from = dragFrom;
    dragFrom = null;
    brush.hidden = true;
    const hm = state.heatmap;
    const to = heatmapCellAt(event) || from;
    if (Math.abs(to.x - from.x) > 4 && from.c !== to.c) {
      const c0 = Math.min(from.c, to.c);
      const c1 = Math.max(from.c, to.c);
      setHash({ start: hm.steps[c0], end: stepRangeOfColumn(hm, c1)[1] });
    } else {
      setHash({ layer: hm.layers[from.r], step: hm.steps[from.c] });
    }
  });
}
// Each load counts up; an answer that arrives after a newer request started is dropped.
let heatmapSeq = 0;
export async function loadHeatmap() {
  const seq = ++heatmapSeq;
  const canvas = $("heatmap");
  if (!state.metric) {
    state.heatmap = null;
    drawHeatmap();
    showOverlay("heatmap-empty", "This run has no per-layer metrics yet.");
    $("heatmap-info").textContent = "";
    return;
  }
  canvas.setAttribute("aria-busy", "true");
  let body;
  try {
    const params = {
      metric: state.metric,
      agg: bucketAggregate(state.metric),
      layers: state.glob,
      start: state.start,
      end: state.end,
      max_steps: heatmapColumns(),
    };
    body = await heatmapForRanks(`/runs/${encodeURIComponent(state.run)}/heatmap`, params, lowerIsWorse(state.metric));
  } catch (err) {
    if (seq !== heatmapSeq) return;
    state.heatmap = null;
    drawHeatmap();
    showOverlay("heatmap-empty", `Could not load the heatmap: ${describeError(err)}`);
    canvas.removeAttribute("aria-busy");
    return;
  }
  if (seq !== heatmapSeq) return;
  const hm = prepareHeatmap(body, state.metric);
  hm.agg = bucketAggregate(state.metric);
  hm.lastStep = state.end !== null ? state.end : pick(state.detail, "last_step");
  hm.bucketSteps = Math.max(1, Number(body.bucket_steps) || 1);
  hm.exact = hm.bucketSteps === 1;
  state.heatmap = hm;
  if (hm.rows === 0 || hm.cols === 0) {
    showOverlay("heatmap-empty", state.glob ? `No layer matches “${state.glob}”.` : "No points in this step range.");
  } else {
    showOverlay("heatmap-empty", null);
  }
  const ranksText = hm.worstRank ? `, the worst of ${runRanks().length} ranks` : "";
  $("heatmap-info").textContent =
    hm.rows && hm.cols ? `${hm.rows} layers × ${hm.cols} columns, steps ${hm.steps[0]}–${hm.lastStep ?? hm.steps[hm.cols - 1]}${ranksText}` : "";
  drawHeatmap();
  canvas.removeAttribute("aria-busy");
  canvas.dataset.ready = String(seq);
  if (!state.layer && hm.rows > 0) {
    // Start on the worst layer: the one with the largest finite value (or smallest, where high is good).
    let best = -1;
    let bestValue = null;
    const better = lowerIsWorse(state.metric) ? (a, b) => a < b : (a, b) => a > b;
    for (let i = 0; i < hm.values.length; i++) {
      const v = hm.values[i];
      if (v !== null && Number.isFinite(v) && (bestValue === null || better(v, bestValue))) {
        bestValue = v;
        best = i;
      }
    }
    state.layer = hm.layers[best >= 0 ? Math.floor(best / hm.cols) : 0];
    loadSeries();
  }
}
