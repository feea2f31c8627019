// QuantWatch web view. Plain JavaScript over the public REST API (/api/v1/...); no build step, no dependencies.
// State lives in the URL hash (#run=...&metric=...&layer=...&step=...&start=...&end=...&agg=...), so every view
// can be linked to and the browser's back button works.
"use strict";

const API = "api/v1";
const LIVE_INTERVAL_MS = 5000;
const MAX_HEATMAP_COLUMNS = 500;
const TOKEN_KEY = "quantwatch.token";

const $ = (id) => document.getElementById(id);

const state = {
  runs: [],
  run: null, // selected run name
  detail: null, // GET /runs/{run}
  metric: null,
  agg: "worst", // bucket aggregate: "worst" is max, or min where a high value is good (cosine, SQNR)
  glob: "",
  start: null,
  end: null,
  layer: null,
  step: null,
  rank: null, // null: the collector's default (rank 0)
  alertState: "",
  rules: [], // GET /rules: the alert rules, whose bounds the heatmap and the charts draw
  heatmap: null, // last heatmap answer plus derived colours
  series: null,
  loss: null,
};

// ---------------------------------------------------------------------------------------------------------------
// REST client

class ApiError extends Error {
  constructor(status, title, detail, path) {
    super(`${status} ${title}${detail ? ": " + detail : ""}`);
    this.status = status;
    this.title = title;
    this.detail = detail;
    this.path = path;
  }
}

async function api(path, params) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== null && v !== undefined && v !== "") query.set(k, String(v));
  }
  const url = `${API}${path}${query.toString() ? "?" + query : ""}`;
  const headers = { Accept: "application/json" };
  const token = localStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(url, { headers });
  } catch (err) {
    throw new ApiError(0, "collector unreachable", String(err.message || err), url);
  }
  if (!response.ok) {
    let title = response.statusText || "error";
    let detail = "";
    try {
      const problem = await response.json(); // RFC 9457 problem+json
      title = problem.title || title;
      detail = problem.detail || "";
    } catch (_) {
      // Not JSON: keep the status line.
    }
    const err = new ApiError(response.status, title, detail, url);
    if (response.status === 401 || response.status === 403) showAuthProblem(err);
    throw err;
  }
  return response.json();
}

function listOf(body, key) {
  if (Array.isArray(body)) return body;
  if (body && Array.isArray(body[key])) return body[key];
  if (body && Array.isArray(body.items)) return body.items;
  return [];
}

function pick(obj, ...names) {
  for (const n of names) {
    if (obj && obj[n] !== undefined && obj[n] !== null) return obj[n];
  }
  return null;
}

// ---------------------------------------------------------------------------------------------------------------
// Values: numbers, null (not measured) and the strings "nan", "inf", "-inf" of the wire format.

function toNumber(v) {
  if (v === null || v === undefined) return null;
  if (typeof v === "number") return v;
  if (v === "nan" || v === "NaN") return NaN;
  if (v === "inf" || v === "+inf" || v === "Infinity") return Infinity;
  if (v === "-inf" || v === "-Infinity") return -Infinity;
  const n = Number(v);
  return Number.isNaN(n) ? null : n;
}

function isRatioMetric(metric) {
  return /_rel_l2$|_ratio$/.test(metric || "");
}

function higherIsBetter(metric) {
  return /cosine|sqnr/.test(metric || "");
}

// What a bucket of several steps shows: the chosen aggregate, or for "worst" the one that keeps a bad step visible.
function bucketAggregate(metric) {
  if (state.agg !== "worst") return state.agg;
  return higherIsBetter(metric) ? "min" : "max";
}

function formatValue(v, metric) {
  if (v === null) return "not measured";
  if (Number.isNaN(v)) return "NaN";
  if (v === Infinity) return "+inf";
  if (v === -Infinity) return "−inf";
  const abs = Math.abs(v);
  let text;
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) text = v.toExponential(3);
  else text = String(Number(v.toPrecision(5)));
  if (isRatioMetric(metric) && Number.isFinite(v)) text += ` (${(v * 100).toPrecision(3)}%)`;
  return text;
}

function formatBound(bound, metric) {
  const t = bound.threshold;
  return `${bound.op} ${isRatioMetric(metric) ? `${Number((t * 100).toPrecision(4))}%` : formatTick(t)}`;
}

function formatTick(v) {
  const abs = Math.abs(v);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return v.toExponential(1);
  return String(Number(v.toPrecision(3)));
}

// Round tick values (1, 2, 5 × 10^k) covering [lo, hi], about `count` of them.
function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function formatTime(t) {
  if (t === null) return "—";
  const date = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  if (Number.isNaN(date.getTime())) return String(t);
  return date.toLocaleString();
}

// ---------------------------------------------------------------------------------------------------------------
// Alert rule bounds: what the collector's rules call a breach, per (metric, layer) of the open run, so the heatmap
// and the charts mark the bound that actually alerts (a shipped 5% default, a rules file's 25% for FP4 layers, a
// cosine floor of 0.95) instead of one constant.

const globCache = new Map();

// Python 3.11's fnmatch.translate, which the collector's rule globs go through, ported character for character
// (code points, not UTF-16 units): *, ?, [seq], [!seq]; a backwards range such as [8-1] is dropped, an empty set
// matches nothing and [!] any character, as in Python; case-sensitive.
function globRegExp(glob) {
  let re = globCache.get(glob);
  if (re) return re;
  const pat = Array.from(glob);
  const n = pat.length;
  const escape = (ch) => ch.replace(/[.*+?^${}()|[\]\\/]/g, "\\$&");
  const inClass = (ch) => ch.replace(/[\\\]\[^-]/g, "\\$&");
  let source = "";
  let i = 0;
  while (i < n) {
    const c = pat[i++];
    if (c === "*") {
      source += ".*";
    } else if (c === "?") {
      source += ".";
    } else if (c !== "[") {
      source += escape(c);
    } else {
      let j = i;
      if (j < n && pat[j] === "!") j++;
      if (j < n && pat[j] === "]") j++;
      while (j < n && pat[j] !== "]") j++;
      if (j >= n) {
        source += "\\[";
        continue;
      }
      let chunks;
      if (!pat.slice(i, j).includes("-")) {
        chunks = [pat.slice(i, j)];
      } else {
        chunks = [];
        let start = i;
        let k = pat[i] === "!" ? i + 2 : i + 1;
        for (;;) {
          k = pat.indexOf("-", k);
          if (k < 0 || k >= j) break;
          chunks.push(pat.slice(start, k));
          start = k + 1;
          k += 3;
        }
        const chunk = pat.slice(start, j);
        if (chunk.length) chunks.push(chunk);
        else chunks[chunks.length - 1] = [...chunks[chunks.length - 1], "-"];
        // Remove empty (backwards) ranges, as Python does.
        for (let m = chunks.length - 1; m > 0; m--) {
          const last = chunks[m - 1][chunks[m - 1].length - 1];
          if (last.codePointAt(0) > chunks[m][0].codePointAt(0)) {
            chunks[m - 1] = [...chunks[m - 1].slice(0, -1), ...chunks[m].slice(1)];
            chunks.splice(m, 1);
          }
        }
      }
      i = j + 1;
      // Hyphens between chunks make ranges; every other special character is literal.
      const negated = chunks.length > 0 && chunks[0].length > 0 && chunks[0][0] === "!";
      if (negated) chunks[0] = chunks[0].slice(1);
      const body = chunks.map((chunk) => chunk.map(inClass).join("")).join("-");
      if (!body) source += negated ? "." : "(?!)";
      else source += `[${negated ? "^" : ""}${body}]`;
    }
  }
  re = new RegExp(`^(?:${source})$`, "su");
  globCache.set(glob, re);
  return re;
}

function globMatches(glob, name) {
  return globRegExp(glob).test(name);
}

// A breach of `op threshold` as the collector decides it: on the float32 value (the API spells float32 values in
// their shortest form: 0.95 stands for 0.949999988…, which is < 0.95), and non-finite values breach every rule.
// ">" and ">=" say high values are bad, "<" and "<=" low ones.
function breaches(bound, value) {
  if (!Number.isFinite(value)) return true;
  const v = Math.fround(value);
  switch (bound.op) {
    case ">":
      return v > bound.threshold;
    case ">=":
      return v >= bound.threshold;
    case "<":
      return v < bound.threshold;
    default:
      return v <= bound.threshold;
  }
}

function lowIsBad(bound) {
  return bound.op === "<" || bound.op === "<=";
}

// The enabled rules on `metric` that apply to the open run and to `layer`, one entry per distinct (op, threshold).
function ruleBounds(metric, layer) {
  const bounds = new Map();
  for (const rule of state.rules) {
    if (!rule.enabled || rule.metric !== metric || !globMatches(rule.runs || "*", state.run || "")) continue;
    // A baseline rule's bound is relative to each series' start, and the view does not know layer formats: such
    // rules draw no fixed line (a rule that only excludes formats applies to layers of unknown format, as here).
    if (rule.baseline || rule.formats) continue;
    const globs = Array.isArray(rule.layers) ? rule.layers : [rule.layers || "*"];
    if (!globs.some((g) => globMatches(g, layer))) continue;
    const key = `${rule.op} ${rule.threshold}`;
    const bound = bounds.get(key);
    if (bound) bound.rules.push(rule.name);
    else bounds.set(key, { op: rule.op, threshold: Number(rule.threshold), rules: [rule.name] });
  }
  return [...bounds.values()];
}

// The bound a layer's cells are coloured against: the tightest one in the metric's bad direction (the first to
// breach), or null when no rule watches the layer.
function rowBound(metric, layer) {
  const bounds = ruleBounds(metric, layer);
  if (bounds.length === 0) return null;
  const wantLow = higherIsBetter(metric);
  const sameWay = bounds.filter((b) => lowIsBad(b) === wantLow);
  const pool = sameWay.length ? sameWay : bounds;
  const low = lowIsBad(pool[0]);
  return pool.filter((b) => lowIsBad(b) === low).reduce((a, b) => ((low ? b.threshold > a.threshold : b.threshold < a.threshold) ? b : a));
}

// ---------------------------------------------------------------------------------------------------------------
// Colour scales. Where alert rules watch the metric, each layer's row is split at its own rule bound (`rowBound`):
// blues on the safe side, reds past the bound, so a breaching layer stands out at a glance and an FP4 layer held to
// 25% is not painted red for a 10% its rule accepts; rows no rule watches are grey. Ratio metrics (…_rel_l2, …_ratio)
// are drawn on a log scale. Without any rule on the metric: a sequential scale, reversed where a high value is good
// (cosine, SQNR) so that bad always looks hot.

const BELOW = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
const ABOVE = [[254, 217, 118], [253, 141, 60], [227, 26, 28], [128, 0, 38]];
const SEQUENTIAL = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
const GREY = [[238, 238, 238], [48, 48, 48]];
const NONFINITE = [209, 0, 209];
const HATCH_DARK = [205, 210, 218];
const HATCH_LIGHT = [238, 240, 243];

function ramp(stops, t) {
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  const a = stops[i];
  const b = stops[i + 1];
  return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
}

// Palettes sampled once into lookup tables: colouring 256k cells then costs a table read per cell, not a ramp.
const LUT_SIZE = 1024;

function buildLut(stops) {
  const lut = new Uint8ClampedArray(LUT_SIZE * 3);
  for (let i = 0; i < LUT_SIZE; i++) {
    const c = ramp(stops, i / (LUT_SIZE - 1));
    lut[i * 3] = c[0];
    lut[i * 3 + 1] = c[1];
    lut[i * 3 + 2] = c[2];
  }
  return lut;
}

const BELOW_LUT = buildLut(BELOW);
const ABOVE_LUT = buildLut(ABOVE);
const SEQUENTIAL_LUT = buildLut(SEQUENTIAL);
const GREY_LUT = buildLut(GREY);

function copyLut(lut, t, out, o) {
  const i = Math.round(Math.min(1, Math.max(0, t)) * (LUT_SIZE - 1)) * 3;
  out[o] = lut[i];
  out[o + 1] = lut[i + 1];
  out[o + 2] = lut[i + 2];
}

function valueRange(values) {
  let lo = Infinity;
  let hi = -Infinity;
  let minPositive = Infinity;
  for (const v of values) {
    if (v === null || !Number.isFinite(v)) continue;
    if (v < lo) lo = v;
    if (v > hi) hi = v;
    if (v > 0 && v < minPositive) minPositive = v;
  }
  return lo === Infinity ? { lo: 0, hi: 1, minPositive } : { lo, hi, minPositive };
}

// A position in [0, 1] for every value: log for ratio metrics with positive bounds and for wide positive ranges.
function scalePosition(metric, range, thresholds) {
  let { lo, hi } = range;
  if (isRatioMetric(metric) && thresholds.length > 0 && Math.min(...thresholds) > 0) {
    hi = Math.max(hi, Math.max(...thresholds) * 2);
    const floor = range.minPositive === Infinity ? hi * 1e-4 : range.minPositive;
    lo = Math.min(Math.max(floor, hi * 1e-5), Math.min(...thresholds) / 4);
    const logLo = Math.log10(lo);
    const logHi = Math.log10(hi);
    return { lo, hi, pos: (v) => (v <= 0 ? 0 : Math.min(1, Math.max(0, (Math.log10(v) - logLo) / (logHi - logLo)))) };
  }
  if (thresholds.length > 0) {
    lo = Math.min(lo, ...thresholds);
    hi = Math.max(hi, ...thresholds);
  }
  if (hi === lo) hi = lo + (lo === 0 ? 1 : Math.abs(lo) * 0.01);
  const clamp = (t) => Math.min(1, Math.max(0, t));
  if (lo > 0 && hi / lo > 100) {
    const logLo = Math.log10(lo);
    const logHi = Math.log10(hi);
    return { lo, hi, pos: (v) => (v <= 0 ? 0 : clamp((Math.log10(v) - logLo) / (logHi - logLo))) };
  }
  return { lo, hi, pos: (v) => clamp((v - lo) / (hi - lo)) };
}

// `bounds`: the distinct row bounds of the heatmap, most rows first (empty when no rule watches the metric).
function makeScale(metric, values, bounds) {
  const { lo, hi, pos } = scalePosition(metric, valueRange(values), bounds.map((b) => b.threshold));
  const reverse = higherIsBetter(metric);
  return {
    kind: bounds.length > 0 ? "bounded" : "sequential",
    lo,
    hi,
    pos,
    reverse,
    bounds,
    // How a row is coloured: against its bound (with the bound's position computed once), or unwatched.
    style(bound) {
      return bound ? { bound, at: pos(bound.threshold), low: lowIsBad(bound) } : null;
    },
    // Writes the colour of finite value v at out[o..o+2]; the side of the bound is decided on v itself.
    fill(v, out, o, style) {
      const t = pos(v);
      if (style === null) {
        if (bounds.length > 0) copyLut(GREY_LUT, t, out, o);
        else copyLut(SEQUENTIAL_LUT, reverse ? 1 - t : t, out, o);
      } else if (breaches(style.bound, v)) {
        copyLut(ABOVE_LUT, style.low ? (style.at - t) / (style.at || 1) : (t - style.at) / (1 - style.at || 1), out, o);
      } else {
        copyLut(BELOW_LUT, style.low ? (1 - t) / (1 - style.at || 1) : t / (style.at || 1), out, o);
      }
    },
  };
}

function drawLegend(scale, metric, unwatched) {
  const canvas = $("legend");
  const { ctx, width } = setupCanvas(canvas, 360, 58);
  ctx.clearRect(0, 0, width, 58);
  const x0 = 8;
  const barW = width - 16;
  const main = scale.kind === "bounded" ? scale.style(scale.bounds[0]) : null;
  for (let i = 0; i < barW; i++) {
    const t = i / (barW - 1);
    let rgb;
    if (main === null) {
      rgb = ramp(SEQUENTIAL, scale.reverse ? 1 - t : t);
    } else if (main.low) {
      rgb = t < main.at ? ramp(ABOVE, (main.at - t) / (main.at || 1)) : ramp(BELOW, (1 - t) / (1 - main.at || 1));
    } else {
      rgb = t > main.at ? ramp(ABOVE, (t - main.at) / (1 - main.at || 1)) : ramp(BELOW, t / (main.at || 1));
    }
    ctx.fillStyle = `rgb(${rgb[0] | 0},${rgb[1] | 0},${rgb[2] | 0})`;
    ctx.fillRect(x0 + i, 4, 1, 14);
  }
  ctx.strokeStyle = "#b8c0cc";
  ctx.strokeRect(x0 + 0.5, 4.5, barW - 1, 13);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#475467";
  ctx.textBaseline = "top";
  const label = (t, text, align) => {
    ctx.textAlign = align;
    ctx.fillText(text, x0 + t * (barW - 1), 23);
  };
  label(0, formatTick(scale.lo), "left");
  label(1, formatTick(scale.hi), "right");
  ctx.textAlign = "center";
  if (main === null) {
    ctx.fillText(metric + (scale.reverse ? " (low is bad)" : ""), x0 + barW / 2, 23);
    return;
  }
  // One marker per threshold; bounds of opposite direction at the same value share it.
  const labels = new Map();
  for (const bound of scale.bounds) {
    labels.set(bound.threshold, [...(labels.get(bound.threshold) || []), formatBound(bound, metric)]);
  }
  for (const [threshold, texts] of labels) {
    const x = x0 + scale.pos(threshold) * (barW - 1);
    ctx.strokeStyle = "#111";
    ctx.lineWidth = 2;
    ctx.beginPath();
    ctx.moveTo(x, 1);
    ctx.lineTo(x, 21);
    ctx.stroke();
    ctx.fillStyle = "#111";
    const text = texts.join(" · ");
    const half = ctx.measureText(text).width / 2;
    ctx.fillText(text, Math.min(Math.max(x, x0 + half), x0 + barW - half), 23);
  }
  ctx.fillStyle = "#475467";
  ctx.fillText(`red: past its layer's rule${unwatched ? " · grey: no rule on the layer" : ""}`, x0 + barW / 2, 40);
}

// ---------------------------------------------------------------------------------------------------------------
// Canvas helpers

function setupCanvas(canvas, cssWidth, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.round(cssWidth * dpr);
  canvas.height = Math.round(cssHeight * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return { ctx, dpr, width: cssWidth, height: cssHeight };
}

function showOverlay(id, text) {
  const el = $(id);
  if (text) {
    el.textContent = text;
    el.hidden = false;
  } else {
    el.hidden = true;
  }
}

function placeTooltip(tooltip, wrap, x, y) {
  tooltip.hidden = false;
  const w = tooltip.offsetWidth;
  const h = tooltip.offsetHeight;
  let left = x + 14;
  let top = y + 14;
  if (left + w > wrap.clientWidth) left = Math.max(0, x - w - 14);
  if (top + h > wrap.clientHeight) top = Math.max(0, y - h - 14);
  tooltip.style.left = `${left}px`;
  tooltip.style.top = `${top}px`;
}

function ellipsizeLeft(ctx, text, maxWidth) {
  if (ctx.measureText(text).width <= maxWidth) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (ctx.measureText("…" + text.slice(mid)).width <= maxWidth) hi = mid;
    else lo = mid + 1;
  }
  return "…" + text.slice(lo);
}

// ---------------------------------------------------------------------------------------------------------------
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

function prepareHeatmap(body, metric) {
  const layers = body.layers || [];
  const steps = body.steps || [];
  const rows = layers.length;
  const cols = steps.length;
  const values = new Array(rows * cols);
  const flat = [];
  for (let r = 0; r < rows; r++) {
    const row = (body.values && body.values[r]) || [];
    for (let c = 0; c < cols; c++) {
      const v = toNumber(row[c] === undefined ? null : row[c]);
      values[r * cols + c] = v;
      if (v !== null) flat.push(v);
    }
  }
  // Each row against its own rule bound; the legend lists the distinct bounds, the most common first.
  const bounds = layers.map((layer) => rowBound(metric, layer));
  const tally = new Map();
  for (const b of bounds) {
    if (!b) continue;
    const key = `${b.op} ${b.threshold}`;
    const seen = tally.get(key);
    if (seen) seen.rows++;
    else tally.set(key, { bound: b, rows: 1 });
  }
  const distinct = [...tally.values()].sort((a, b) => b.rows - a.rows).map((entry) => entry.bound);
  const scale = makeScale(metric, flat, distinct);
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
  const unwatched = distinct.length > 0 && bounds.includes(null);
  return { layers, steps, rows, cols, raw: body.values || [], values, scale, bounds, unwatched, rgb, kind, metric };
}

function drawHeatmap() {
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

  // Left gutter sized to the layer names (ellipsized from the left: the end of a qualified name says the most).
  ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
  let labelWidth = 0;
  for (const name of hm.layers) labelWidth = Math.max(labelWidth, ctx.measureText(name).width);
  const left = Math.round(Math.min(240, Math.max(60, labelWidth + 12)));
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
    ctx.fillText(ellipsizeLeft(ctx, hm.layers[r], left - 8), left - 6, y);
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
  drawLegend(hm.scale, hm.metric, hm.unwatched);
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
  line(hm.exact || first === last ? "step" : "steps", stepText.replace(/^steps? /, ""));
  line(hm.metric, formatValue(value, hm.metric));
  const bound = hm.bounds[cell.r];
  if (bound) {
    const past = value !== null && breaches(bound, value);
    line("rule", `${bound.rules.join(", ")} ${formatBound(bound, hm.metric)}${past ? " (past it)" : ""}`);
  }
  placeTooltip(tooltip, $("heatmap-wrap"), cell.x, cell.y);
}

function installHeatmapEvents() {
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

// ---------------------------------------------------------------------------------------------------------------
// Line charts: a series' mean with its min/max band, the loss against the shadow's loss.

const CHART = { left: 58, right: 14, top: 10, bottom: 26 };

function drawChart(canvas, spec) {
  const wrap = canvas.parentElement;
  const width = Math.max(280, wrap.clientWidth);
  const height = 240;
  const { ctx } = setupCanvas(canvas, width, height);
  ctx.clearRect(0, 0, width, height);
  canvas._chart = null;
  let xmin = Infinity;
  let xmax = -Infinity;
  let ymin = Infinity;
  let ymax = -Infinity;
  for (const line of spec.lines) {
    for (let i = 0; i < line.steps.length; i++) {
      xmin = Math.min(xmin, line.steps[i]);
      xmax = Math.max(xmax, line.steps[i]);
      for (const v of [line.min[i], line.mean[i], line.max[i]]) {
        if (v !== null && Number.isFinite(v)) {
          ymin = Math.min(ymin, v);
          ymax = Math.max(ymax, v);
        }
      }
    }
  }
  if (xmin === Infinity) return false;
  if (ymin === Infinity) {
    ymin = 0;
    ymax = 1;
  }
  // A rule bound joins the y range when the data come within a span of it (a far-off bound would flatten the line).
  const span = Math.max(ymax - ymin, Math.abs(ymax) * 0.05);
  for (const bound of spec.bounds) {
    if (bound.threshold >= ymin - span && bound.threshold <= ymax + span) {
      ymax = Math.max(ymax, bound.threshold);
      ymin = Math.min(ymin, bound.threshold);
    }
  }
  if (spec.zeroBased && ymin > 0) ymin = 0;
  if (ymax === ymin) {
    ymax += Math.abs(ymax) * 0.05 || 1;
    ymin -= Math.abs(ymin) * 0.05 || 0;
  }
  const pad = (ymax - ymin) * 0.06;
  ymax += pad;
  if (!spec.zeroBased || ymin < 0) ymin -= pad;
  if (xmax === xmin) {
    xmin -= 1;
    xmax += 1;
  }
  const plot = { x: CHART.left, y: CHART.top, w: width - CHART.left - CHART.right, h: height - CHART.top - CHART.bottom };
  const xOf = (s) => plot.x + ((s - xmin) / (xmax - xmin)) * plot.w;
  const yOf = (v) => plot.y + (1 - (v - ymin) / (ymax - ymin)) * plot.h;

  // Grid and axes.
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#475467";
  ctx.strokeStyle = "#edf0f4";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of niceTicks(ymin, ymax, 5)) {
    const y = Math.round(yOf(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(plot.x, y);
    ctx.lineTo(plot.x + plot.w, y);
    ctx.stroke();
    ctx.fillText(formatTick(v), plot.x - 6, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const s of niceTicks(xmin, xmax, Math.max(2, Math.floor(plot.w / 90)))) {
    if (Number.isInteger(s)) ctx.fillText(String(s), xOf(s), plot.y + plot.h + 6);
  }
  ctx.strokeStyle = "#98a2b3";
  ctx.strokeRect(plot.x + 0.5, plot.y + 0.5, plot.w, plot.h);

  ctx.save();
  ctx.beginPath();
  ctx.rect(plot.x, plot.y, plot.w, plot.h);
  ctx.clip();
  ctx.textAlign = "right";
  ctx.textBaseline = "bottom";
  const drawnBounds = [];
  for (const bound of spec.bounds) {
    if (bound.threshold < ymin || bound.threshold > ymax) continue;
    drawnBounds.push(formatBound(bound, spec.metric));
    const y = yOf(bound.threshold);
    ctx.strokeStyle = "#c62828";
    ctx.setLineDash([5, 4]);
    ctx.beginPath();
    ctx.moveTo(plot.x, y);
    ctx.lineTo(plot.x + plot.w, y);
    ctx.stroke();
    ctx.setLineDash([]);
    ctx.fillStyle = "#c62828";
    ctx.fillText(`${bound.rules.join(", ")} ${formatBound(bound, spec.metric)}`, plot.x + plot.w - 4, y - 2);
  }
  for (const line of spec.lines) {
    if (line.band) {
      // Min/max band: a polygon over runs of finite points (gaps break it).
      ctx.fillStyle = line.bandColor;
      let open = false;
      let upper = [];
      const flush = () => {
        if (upper.length > 0) {
          ctx.beginPath();
          upper.forEach(([s, _lo, hi], k) => (k === 0 ? ctx.moveTo(xOf(s), yOf(hi)) : ctx.lineTo(xOf(s), yOf(hi))));
          for (let k = upper.length - 1; k >= 0; k--) ctx.lineTo(xOf(upper[k][0]), yOf(upper[k][1]));
          ctx.closePath();
          ctx.fill();
        }
        upper = [];
        open = false;
      };
      for (let i = 0; i < line.steps.length; i++) {
        const lo = line.min[i];
        const hi = line.max[i];
        if (lo !== null && hi !== null && Number.isFinite(lo) && Number.isFinite(hi)) {
          upper.push([line.steps[i], lo, hi]);
          open = true;
        } else if (open) flush();
      }
      flush();
    }
    ctx.strokeStyle = line.color;
    ctx.lineWidth = 1.6;
    ctx.setLineDash(line.dash || []);
    ctx.beginPath();
    let penDown = false;
    for (let i = 0; i < line.steps.length; i++) {
      const v = line.mean[i];
      if (v === null || !Number.isFinite(v)) {
        penDown = false;
        continue;
      }
      const x = xOf(line.steps[i]);
      const y = yOf(v);
      if (penDown) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      penDown = true;
    }
    if (line.steps.length === 1 && line.mean[0] !== null) {
      ctx.arc(xOf(line.steps[0]), yOf(line.mean[0]), 2.5, 0, 2 * Math.PI);
    }
    ctx.stroke();
    ctx.setLineDash([]);
    // Non-finite points are signals: mark them on the top edge.
    ctx.fillStyle = "rgb(209,0,209)";
    for (let i = 0; i < line.steps.length; i++) {
      const v = line.max[i];
      if (v !== null && !Number.isFinite(v)) ctx.fillRect(xOf(line.steps[i]) - 1.5, plot.y, 3, 6);
    }
  }
  if (spec.marker !== null && spec.marker >= xmin && spec.marker <= xmax) {
    ctx.strokeStyle = "#111";
    ctx.setLineDash([2, 3]);
    ctx.beginPath();
    ctx.moveTo(Math.round(xOf(spec.marker)) + 0.5, plot.y);
    ctx.lineTo(Math.round(xOf(spec.marker)) + 0.5, plot.y + plot.h);
    ctx.stroke();
    ctx.setLineDash([]);
  }
  ctx.restore();
  canvas._chart = { plot, xmin, xmax, spec };
  canvas.dataset.bounds = JSON.stringify(drawnBounds);
  return true;
}

function installChartHover(canvasId, tooltipId) {
  const canvas = $(canvasId);
  const tooltip = $(tooltipId);
  canvas.addEventListener("mousemove", (event) => {
    const chart = canvas._chart;
    if (!chart) return;
    const rect = canvas.getBoundingClientRect();
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top;
    if (x < chart.plot.x || x > chart.plot.x + chart.plot.w) {
      tooltip.hidden = true;
      return;
    }
    const step = chart.xmin + ((x - chart.plot.x) / chart.plot.w) * (chart.xmax - chart.xmin);
    tooltip.innerHTML = "";
    let nearestStep = null;
    for (const line of chart.spec.lines) {
      let best = -1;
      for (let i = 0; i < line.steps.length; i++) {
        if (best < 0 || Math.abs(line.steps[i] - step) < Math.abs(line.steps[best] - step)) best = i;
      }
      if (best < 0) continue;
      nearestStep = line.steps[best];
      const div = document.createElement("div");
      const key = document.createElement("span");
      key.className = "k";
      key.textContent = `${line.name} `;
      const val = document.createElement("b");
      const mean = line.mean[best];
      val.textContent = formatValue(mean, chart.spec.metric);
      div.append(key, val);
      if (line.band && line.min[best] !== line.max[best]) {
        const range = document.createElement("span");
        range.className = "k";
        range.textContent = ` [${formatValue(line.min[best], "")} … ${formatValue(line.max[best], "")}]`;
        div.append(range);
      }
      tooltip.append(div);
    }
    if (nearestStep === null) {
      tooltip.hidden = true;
      return;
    }
    const head = document.createElement("div");
    head.innerHTML = `<span class="k">step</span> <b>${nearestStep}</b>`;
    tooltip.prepend(head);
    placeTooltip(tooltip, canvas.parentElement, x, y);
  });
  canvas.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
}

function seriesFromBody(body) {
  const steps = body.steps || [];
  const conv = (arr) => steps.map((_, i) => toNumber(arr && arr[i] !== undefined ? arr[i] : null));
  return { steps, min: conv(body.min), mean: conv(body.mean), max: conv(body.max) };
}

// ---------------------------------------------------------------------------------------------------------------
// Loading

let heatmapSeq = 0;
let seriesSeq = 0;
let lossSeq = 0;
let alertsSeq = 0;

// `source` says which loader raised the banner, so a later success of that loader (and only that one) clears it.
function showBanner(text, source) {
  $("banner-text").textContent = text;
  $("banner").dataset.source = source;
  $("banner").hidden = false;
}

function clearBanner(source) {
  if (source && $("banner").dataset.source !== source) return;
  $("banner").hidden = true;
  $("token-form").hidden = true;
}

function showAuthProblem(err) {
  showBanner(
    err.status === 401
      ? "This collector needs a token with the read scope (401 Unauthorized)."
      : "The token in use lacks the read scope (403 Forbidden).",
    "auth",
  );
  $("token-form").hidden = false;
}

function describeError(err) {
  if (err instanceof ApiError) {
    if (err.status === 0) return `Cannot reach the collector (${err.detail}).`;
    return `${err.status} ${err.title}${err.detail ? " — " + err.detail : ""}`;
  }
  return String(err);
}

async function loadRuns() {
  let body;
  try {
    body = await api("/runs");
  } catch (err) {
    if (!(err instanceof ApiError && (err.status === 401 || err.status === 403))) {
      showBanner(`Could not list runs: ${describeError(err)}`, "runs");
    }
    return false;
  }
  clearBanner("runs");
  clearBanner("auth");
  // Most recently active first.
  state.runs = listOf(body, "runs")
    .slice()
    .sort((a, b) => (pick(b, "last_seen_at") ?? 0) - (pick(a, "last_seen_at") ?? 0));
  renderRuns();
  return true;
}

function runName(run) {
  return typeof run === "string" ? run : pick(run, "name", "run");
}

function renderRuns() {
  const list = $("runs-list");
  list.innerHTML = "";
  $("runs-empty").hidden = state.runs.length > 0;
  for (const run of state.runs) {
    const name = runName(run);
    const li = document.createElement("li");
    const a = document.createElement("a");
    a.href = "#" + new URLSearchParams({ run: name }).toString();
    a.className = name === state.run ? "selected" : "";
    a.dataset.run = name;
    const title = document.createElement("div");
    title.className = "run-name";
    title.textContent = name;
    const firing = pick(run, "firing_alerts", "firing_alert_count", "alerts_firing");
    if (firing) {
      const badge = document.createElement("span");
      badge.className = "badge";
      badge.title = `${firing} firing alert(s)`;
      badge.textContent = String(firing);
      title.append(badge);
    }
    const meta = document.createElement("div");
    meta.className = "run-meta";
    const first = pick(run, "first_step");
    const last = pick(run, "last_step");
    const layers = pick(run, "layer_count", "layers");
    const parts = [];
    if (first !== null && last !== null) parts.push(`steps ${first}–${last}`);
    if (layers !== null) parts.push(`${Array.isArray(layers) ? layers.length : layers} layers`);
    meta.textContent = parts.join(" · ");
    a.append(title, meta);
    li.append(a);
    list.append(li);
  }
}

function metricsOf(detail) {
  const raw = pick(detail, "metrics", "metrics_seen") || [];
  return raw.map((m) => (typeof m === "string" ? m : pick(m, "name", "metric"))).filter(Boolean);
}

// The alert rules; kept as they were when the collector cannot answer (the alerts panel reports its errors).
// True when they changed.
async function loadRules() {
  let rules;
  try {
    rules = listOf(await api("/rules"), "rules");
  } catch (_) {
    return false;
  }
  const changed = JSON.stringify(rules) !== JSON.stringify(state.rules);
  state.rules = rules;
  return changed;
}

async function loadRunDetail() {
  try {
    state.detail = await api(`/runs/${encodeURIComponent(state.run)}`);
  } catch (err) {
    state.detail = null;
    $("run-title").textContent = state.run;
    $("run-facts").innerHTML = "";
    if (!(err instanceof ApiError && (err.status === 401 || err.status === 403))) {
      showBanner(`Could not load run ${state.run}: ${describeError(err)}`, "run");
    }
    return false;
  }
  clearBanner("run");
  renderRunHead();
  return true;
}

function renderRunHead() {
  const d = state.detail;
  $("run-title").textContent = state.run;
  const facts = $("run-facts");
  facts.innerHTML = "";
  const add = (k, v) => {
    if (v === null || v === undefined || v === "") return;
    const div = document.createElement("div");
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v;
    div.append(dt, dd);
    facts.append(div);
  };
  const first = pick(d, "first_step");
  const last = pick(d, "last_step");
  add("steps", first !== null && last !== null ? `${first}–${last}` : null);
  const layers = pick(d, "layer_count");
  add("layers", layers !== null ? String(layers) : null);
  add("metrics", String(metricsOf(d).length));
  const ranks = pick(d, "ranks");
  if (Array.isArray(ranks)) add("ranks", ranks.join(", "));
  // A rank picker only when there is more than one rank to pick from.
  const rankSelect = $("rank");
  rankSelect.innerHTML = "";
  const rankList = Array.isArray(ranks) ? ranks : [];
  for (const r of rankList) {
    const opt = document.createElement("option");
    opt.value = String(r);
    opt.textContent = String(r);
    rankSelect.append(opt);
  }
  $("rank-label").hidden = rankList.length < 2;
  if (state.rank !== null && !rankList.includes(state.rank)) state.rank = null;
  rankSelect.value = String(state.rank ?? (rankList.includes(0) ? 0 : rankList[0] ?? ""));
  add("firing alerts", pick(d, "firing_alerts", "firing_alert_count"));
  add("points", pick(d, "points") !== null ? Number(pick(d, "points")).toLocaleString() : null);
  add("last seen", formatTime(pick(d, "last_seen_at")));

  const metrics = metricsOf(d);
  const select = $("metric");
  select.innerHTML = "";
  for (const m of metrics) {
    const opt = document.createElement("option");
    opt.value = m;
    opt.textContent = m;
    select.append(opt);
  }
  if (!state.metric || !metrics.includes(state.metric)) {
    state.metric = metrics.includes("output_rel_l2") ? "output_rel_l2" : metrics[0] || null;
  }
  select.value = state.metric || "";
}

async function loadHeatmap() {
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
    body = await api(`/runs/${encodeURIComponent(state.run)}/heatmap`, {
      metric: state.metric,
      agg: bucketAggregate(state.metric),
      rank: state.rank,
      layers: state.glob,
      start: state.start,
      end: state.end,
      max_steps: heatmapColumns(),
    });
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
  $("heatmap-info").textContent =
    hm.rows && hm.cols ? `${hm.rows} layers × ${hm.cols} columns, steps ${hm.steps[0]}–${hm.lastStep ?? hm.steps[hm.cols - 1]}` : "";
  drawHeatmap();
  canvas.removeAttribute("aria-busy");
  canvas.dataset.ready = String(seq);
  if (!state.layer && hm.rows > 0) {
    // Start on the worst layer: the one with the largest finite value (or smallest, where high is good).
    let best = -1;
    let bestValue = null;
    const better = higherIsBetter(state.metric) ? (a, b) => a < b : (a, b) => a > b;
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

async function loadSeries() {
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

function drawSeries() {
  const canvas = $("series");
  if (!state.series) return;
  const drawn = drawChart(canvas, {
    metric: state.metric,
    bounds: ruleBounds(state.metric, state.layer),
    marker: state.step,
    zeroBased: isRatioMetric(state.metric),
    lines: [{ name: state.metric, ...state.series, color: "#2f6fd6", band: true, bandColor: "rgba(47,111,214,0.18)" }],
  });
  showOverlay("series-empty", drawn ? null : "No points for this layer in this step range.");
}

async function loadLoss() {
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

function drawLoss() {
  const canvas = $("loss");
  const lines = state.loss || [];
  const drawn =
    lines.length > 0 &&
    drawChart(canvas, { metric: "loss", bounds: [], marker: state.step, zeroBased: false, lines });
  if (!drawn) {
    canvas._chart = null;
    setupCanvas(canvas, Math.max(280, canvas.parentElement.clientWidth), 240);
  }
  showOverlay("loss-empty", drawn ? null : "This run reports no loss.");
}

// The step an alert is about: where it fired (or went pending), else its latest transition.
function alertStep(alert) {
  const firing = pick(alert, "firing");
  const pending = pick(alert, "pending");
  return pick(firing, "step") ?? pick(pending, "step") ?? pick(alert, "step");
}

function alertTime(alert) {
  const firing = pick(alert, "firing");
  const pending = pick(alert, "pending");
  return pick(firing, "time") ?? pick(pending, "time");
}

async function loadAlerts() {
  const seq = ++alertsSeq;
  let body;
  try {
    body = await api("/alerts", { run: state.run, state: state.alertState });
  } catch (err) {
    if (seq !== alertsSeq) return;
    $("alerts-body").innerHTML = "";
    const empty = $("alerts-empty");
    empty.textContent =
      err instanceof ApiError && err.status === 404 && !err.detail
        ? "This collector does not serve alerts."
        : `Could not load alerts: ${describeError(err)}`;
    empty.hidden = false;
    return;
  }
  if (seq !== alertsSeq) return;
  const alerts = listOf(body, "alerts");
  const tbody = $("alerts-body");
  tbody.innerHTML = "";
  const empty = $("alerts-empty");
  empty.hidden = alerts.length > 0;
  empty.textContent = state.alertState
    ? `No ${state.alertState} alerts for this run.`
    : "No alerts for this run. Rules are evaluated as points arrive.";
  for (const alert of alerts) {
    const tr = document.createElement("tr");
    const s = String(pick(alert, "state") || "");
    const layer = pick(alert, "layer");
    const metric = pick(pick(alert, "labels") || {}, "metric");
    const step = alertStep(alert);
    const cell = (content, cls) => {
      const td = document.createElement("td");
      if (cls) td.className = cls;
      if (content instanceof Node) td.append(content);
      else td.textContent = content === null ? "—" : String(content);
      tr.append(td);
    };
    const badge = document.createElement("span");
    badge.className = `state ${s}`;
    badge.textContent = s || "?";
    cell(badge);
    cell(pick(alert, "rule"));
    cell(layer);
    cell(metric);
    if (step !== null) {
      const a = document.createElement("a");
      // Scalar rules (no layer) only move the step marker; layer rules also select their layer and metric.
      const target = { step };
      if (layer) target.layer = layer;
      if (layer && metricsOf(state.detail).includes(metric)) target.metric = metric;
      a.href = "#" + hashFor(target);
      a.textContent = String(step);
      a.title = layer ? `Select ${layer} at step ${step}` : `Mark step ${step}`;
      cell(a, "num");
    } else {
      cell(null);
    }
    cell(formatValue(toNumber(pick(alert, "value")), metric), "num");
    cell(pick(pick(alert, "annotations") || {}, "summary"));
    cell(formatTime(alertTime(alert)));
    tbody.append(tr);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// URL hash <-> state

function readHash() {
  const p = new URLSearchParams(location.hash.replace(/^#/, ""));
  const num = (k) => (p.get(k) !== null && p.get(k) !== "" && !Number.isNaN(Number(p.get(k))) ? Number(p.get(k)) : null);
  return {
    run: p.get("run"),
    metric: p.get("metric"),
    agg: ["max", "min", "mean"].includes(p.get("agg")) ? p.get("agg") : "worst",
    glob: p.get("layers") || "",
    start: num("start"),
    end: num("end"),
    layer: p.get("layer"),
    step: num("step"),
    rank: num("rank"),
  };
}

function hashFor(changes) {
  const cur = {
    run: state.run,
    metric: state.metric,
    agg: state.agg,
    layers: state.glob,
    start: state.start,
    end: state.end,
    layer: state.layer,
    step: state.step,
    rank: state.rank,
  };
  const next = { ...cur, ...changes };
  const p = new URLSearchParams();
  for (const k of ["run", "metric", "agg", "rank", "layers", "start", "end", "layer", "step"]) {
    if (next[k] !== null && next[k] !== undefined && next[k] !== "" && !(k === "agg" && next[k] === "worst")) {
      p.set(k, String(next[k]));
    }
  }
  return p.toString();
}

function setHash(changes) {
  location.hash = hashFor(changes);
}

async function applyHash() {
  const h = readHash();
  const runChanged = h.run !== state.run;
  const heatmapChanged =
    runChanged ||
    h.metric !== state.metric ||
    h.agg !== state.agg ||
    h.rank !== state.rank ||
    h.glob !== state.glob ||
    h.start !== state.start ||
    h.end !== state.end;
  const seriesChanged = heatmapChanged || h.layer !== state.layer;
  const stepChanged = h.step !== state.step;
  Object.assign(state, h);
  $("metric").value = state.metric || "";
  $("agg").value = state.agg;
  $("layer-glob").value = state.glob;
  $("zoom-reset").hidden = state.start === null && state.end === null;
  renderRuns();
  if (!state.run) {
    $("welcome").hidden = false;
    $("run-view").hidden = true;
    return;
  }
  $("welcome").hidden = true;
  $("run-view").hidden = false;
  if (runChanged) {
    state.heatmap = null;
    if (!(await loadRunDetail())) return;
  }
  if (heatmapChanged) {
    loadHeatmap();
  } else if (stepChanged) {
    drawHeatmap();
  }
  if (seriesChanged) loadSeries();
  else if (stepChanged) drawSeries();
  if (runChanged || heatmapChanged) loadLoss();
  else if (stepChanged) drawLoss();
  if (runChanged) loadAlerts();
}

// ---------------------------------------------------------------------------------------------------------------
// Live refresh: poll the runs list; reload the selected run's panels only when it has new points.

async function refresh(force) {
  const before = state.runs.find((r) => runName(r) === state.run);
  const beforeKey = before ? JSON.stringify([pick(before, "last_seen_at"), pick(before, "points"), pick(before, "firing_alerts")]) : null;
  if (!(await loadRuns())) return;
  if (!state.run) {
    openLatestRun();
    return;
  }
  const after = state.runs.find((r) => runName(r) === state.run);
  const afterKey = after ? JSON.stringify([pick(after, "last_seen_at"), pick(after, "points"), pick(after, "firing_alerts")]) : null;
  const rulesChanged = await loadRules();
  if (force || beforeKey !== afterKey) {
    if (!(await loadRunDetail())) return;
    loadHeatmap();
    loadSeries();
    loadLoss();
    loadAlerts();
  } else if (rulesChanged) {
    loadHeatmap();
    drawSeries();
  }
}

function installControls() {
  $("metric").addEventListener("change", (e) => setHash({ metric: e.target.value }));
  $("agg").addEventListener("change", (e) => setHash({ agg: e.target.value }));
  $("rank").addEventListener("change", (e) => setHash({ rank: Number(e.target.value) }));
  $("layer-glob").addEventListener("change", (e) => setHash({ layers: e.target.value.trim() }));
  $("zoom-reset").addEventListener("click", () => setHash({ start: null, end: null }));
  $("alert-state").addEventListener("change", (e) => {
    state.alertState = e.target.value;
    loadAlerts();
  });
  $("refresh").addEventListener("click", () => refresh(true));
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const token = $("token-input").value.trim();
    if (token) localStorage.setItem(TOKEN_KEY, token);
    else localStorage.removeItem(TOKEN_KEY);
    clearBanner("auth");
    refresh(true);
  });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      drawHeatmap();
      drawSeries();
      drawLoss();
    }, 150);
  });
  window.addEventListener("hashchange", applyHash);
  setInterval(() => {
    if ($("live").checked && !document.hidden) refresh(false);
  }, LIVE_INTERVAL_MS);
}

// Without a run in the URL, open the most recently active one; true when it did (the hash change loads it).
function openLatestRun() {
  if (readHash().run || state.runs.length === 0) return false;
  setHash({ run: runName(state.runs[0]) });
  return true;
}

async function start() {
  installControls();
  installHeatmapEvents();
  installChartHover("series", "series-tooltip");
  installChartHover("loss", "loss-tooltip");
  await Promise.all([loadRuns(), loadRules()]);
  if (!openLatestRun()) applyHash();
}

start();
