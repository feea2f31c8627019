// The heatmap's colour legend.
import { ABOVE, BELOW, ramp, SEQUENTIAL } from "./colour.js";
import { $, setupCanvas } from "./dom.js";
import { formatBound, formatTick } from "./format.js";

export function drawLegend(scale, metric, unwatched) {
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
