// Line charts (a series' mean with its min/max band, the loss against the shadow's loss) and their hover.
import { placeTooltip, setupCanvas } from "./dom.js";
import { formatBound, formatTick, formatValue, niceTicks, toNumber } from "./format.js";

const CHART = { left: 58, right: 14, top: 10, bottom: 26 };

export function drawChart(canvas, spec) {
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
  // The agent's actions (actions.js): a green line at the step each was taken after, labelled at the top.
  const drawnAnnotations = [];
  for (const note of spec.annotations || []) {
    if (note.step < xmin || note.step > xmax) continue;
    const x = Math.round(xOf(note.step)) + 0.5;
    ctx.strokeStyle = "#1b873f";
    ctx.setLineDash([4, 2]);
    ctx.beginPath();
    ctx.moveTo(x, plot.y);
    ctx.lineTo(x, plot.y + plot.h);
    ctx.stroke();
    ctx.setLineDash([]);
    ctx.fillStyle = "#1b873f";
    ctx.textAlign = x > plot.x + plot.w / 2 ? "right" : "left";
    ctx.fillText(`▲ ${note.label}`, x + (ctx.textAlign === "right" ? -3 : 3), plot.y + 10);
    drawnAnnotations.push({ step: note.step, label: note.label });
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
  canvas.dataset.annotations = JSON.stringify(drawnAnnotations);
  return true;
}

// Fill a `.chart-wrap` whose data-chart is NAME: canvas #NAME (labelled by data-label), its hover tooltip
// #NAME-tooltip and its empty-state overlay #NAME-empty, the ids the series panels draw and write to.
export function mountChart(wrap) {
  const name = wrap.dataset.chart;
  const canvas = document.createElement("canvas");
  canvas.id = name;
  canvas.setAttribute("aria-label", wrap.dataset.label);
  const tooltip = document.createElement("div");
  tooltip.id = `${name}-tooltip`;
  tooltip.className = "tooltip";
  tooltip.hidden = true;
  const empty = document.createElement("p");
  empty.id = `${name}-empty`;
  empty.className = "empty overlay";
  empty.hidden = true;
  wrap.append(canvas, tooltip, empty);
  installChartHover(canvas, tooltip);
}

function installChartHover(canvas, tooltip) {
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
      // "≈": the bucket holds a value the agent estimated from a subset of rows (shadow_rows).
      const estimated = line.estimated && line.estimated.has(line.steps[best]);
      val.textContent = `${estimated ? "≈ " : ""}${formatValue(mean, chart.spec.metric)}`;
      if (estimated) val.title = "estimated from a subset of rows (shadow_rows)";
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
    for (const note of chart.spec.annotations || []) {
      if (note.step !== nearestStep) continue;
      const div = document.createElement("div");
      div.className = "action";
      div.textContent = `▲ ${note.label}: ${note.detail}`;
      tooltip.append(div);
    }
    placeTooltip(tooltip, canvas.parentElement, x, y);
  });
  canvas.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
}

export function seriesFromBody(body) {
  const steps = body.steps || [];
  const conv = (arr) => steps.map((_, i) => toNumber(arr && arr[i] !== undefined ? arr[i] : null));
  const estimated = new Set(body.estimated || []);
  return { steps, min: conv(body.min), mean: conv(body.mean), max: conv(body.max), estimated };
}
