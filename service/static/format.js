// How values, bounds, ticks and times are written.
import { isRatioMetric } from "./catalog.js";

// Values: numbers, null (not measured) and the strings "nan", "inf", "-inf" of the wire format.

export function toNumber(v) {
  if (v === null || v === undefined) return null;
  if (typeof v === "number") return v;
  if (v === "nan" || v === "NaN") return NaN;
  if (v === "inf" || v === "+inf" || v === "Infinity") return Infinity;
  if (v === "-inf" || v === "-Infinity") return -Infinity;
  const n = Number(v);
  return Number.isNaN(n) ? null : n;
}

export function formatValue(v, metric) {
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

export function formatBound(bound, metric) {
  const t = bound.threshold;
  return `${bound.op} ${isRatioMetric(metric) ? `${Number((t * 100).toPrecision(4))}%` : formatTick(t)}`;
}

export function formatTick(v) {
  const abs = Math.abs(v);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return v.toExponential(1);
  return String(Number(v.toPrecision(3)));
}

// Round tick values (1, 2, 5 × 10^k) covering [lo, hi], about `count` of them.
export function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

export function formatTime(t) {
  if (t === null) return "—";
  const date = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  if (Number.isNaN(date.getTime())) return String(t);
  return date.toLocaleString();
}

// A layer's formats ({kind: format}) in a row label: the weight's element format without its scaling ("fp8_e4m3",
// "nvfp4"), else the first declared kind's; "" when unknown. `formatsText` writes the full set, for tooltips.
export function formatLabel(formats) {
  if (!formats) return "";
  const main = formats.weight ?? Object.values(formats)[0];
  return main ? main.split(":")[0] : "";
}

export function formatsText(formats) {
  if (!formats) return "";
  return Object.entries(formats)
    .map(([kind, format]) => `${kind} ${format}`)
    .join(", ");
}
