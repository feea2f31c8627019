// The heatmap's colour legend: one bar per bound the rows are coloured against (each row is split at its own rule's
// bound, so one bar with several marks would show every row's colours at the wrong place), or one sequential bar
// where no rule watches the metric.
import { ABOVE, BELOW, ramp, SEQUENTIAL } from "./colour.js";
import { $, setupCanvas } from "./dom.js";
import { formatBound, formatTick } from "./format.js";

const WIDTH = 360;
const BAR = 14; // height of one bar
const BLOCK = 34; // one bar and its labels
const MAX_BARS = 4;

function barColour(style, reverse, t) {
  if (style === null) return ramp(SEQUENTIAL, reverse ? 1 - t : t);
  if (style.low) {
    return t < style.at ? ramp(ABOVE, (style.at - t) / (style.at || 1)) : ramp(BELOW, (1 - t) / (1 - style.at || 1));
  }
  return t > style.at ? ramp(ABOVE, (t - style.at) / (1 - style.at || 1)) : ramp(BELOW, t / (style.at || 1));
}

// `entries`: the distinct row bounds with how many rows each colours ({bound, rows}), most rows first.
export function drawLegend(canvasId, scale, metric, entries, unwatched) {
  const canvas = $(canvasId);
  const shown = scale.kind === "bounded" ? entries.slice(0, MAX_BARS) : [null];
  const height = 4 + shown.length * BLOCK + (scale.kind === "bounded" ? 16 : 0);
  const { ctx, width } = setupCanvas(canvas, WIDTH, height);
  canvas.style.width = `${WIDTH}px`;
  ctx.clearRect(0, 0, width, height);
  const x0 = 8;
  const barW = width - 16;
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "top";
  const labels = [];
  shown.forEach((entry, k) => {
    const top = 4 + k * BLOCK;
    const style = entry === null ? null : scale.style(entry.bound);
    for (let i = 0; i < barW; i++) {
      const rgb = barColour(style, scale.reverse, i / (barW - 1));
      ctx.fillStyle = `rgb(${rgb[0] | 0},${rgb[1] | 0},${rgb[2] | 0})`;
      ctx.fillRect(x0 + i, top, 1, BAR);
    }
    ctx.strokeStyle = "#b8c0cc";
    ctx.lineWidth = 1;
    ctx.strokeRect(x0 + 0.5, top + 0.5, barW - 1, BAR - 1);
    ctx.fillStyle = "#475467";
    ctx.textAlign = "left";
    ctx.fillText(formatTick(scale.lo), x0, top + BAR + 4);
    ctx.textAlign = "right";
    ctx.fillText(formatTick(scale.hi), x0 + barW, top + BAR + 4);
    ctx.textAlign = "center";
    if (entry === null) {
      const text = metric + (scale.reverse ? " (low is bad)" : "");
      labels.push(text);
      ctx.fillText(text, x0 + barW / 2, top + BAR + 4);
      return;
    }
    const x = x0 + scale.pos(entry.bound.threshold) * (barW - 1);
    ctx.strokeStyle = "#111";
    ctx.lineWidth = 2;
    ctx.beginPath();
    ctx.moveTo(x, top - 3);
    ctx.lineTo(x, top + BAR + 3);
    ctx.stroke();
    const text = `${formatBound(entry.bound, metric)} · ${entry.rows} layer${entry.rows === 1 ? "" : "s"}`;
    labels.push(text);
    ctx.fillStyle = "#111";
    const half = ctx.measureText(text).width / 2;
    ctx.fillText(text, Math.min(Math.max(x, x0 + half + 28), x0 + barW - half - 28), top + BAR + 4);
  });
  canvas.dataset.bars = JSON.stringify(labels);
  if (scale.kind !== "bounded") return;
  const more = entries.length - shown.length;
  ctx.fillStyle = "#475467";
  ctx.textAlign = "center";
  ctx.fillText(
    `red: past its layer's rule${unwatched ? " · grey: no rule on the layer" : ""}${more > 0 ? ` · ${more} more bound(s)` : ""}`,
    x0 + barW / 2,
    4 + shown.length * BLOCK,
  );
}
