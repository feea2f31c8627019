// Colour scales of the heatmap: palettes, lookup tables and the scale a heatmap's cells are coloured on.
import { isRatioMetric, lowerIsWorse } from "./catalog.js";
import { breaches, lowIsBad } from "./rules.js";

// Colour scales. Where alert rules watch the metric, each layer's row is split at its own rule bound (`rowBounds`):
// blues on the safe side, reds past the bound, so a breaching layer stands out at a glance and an FP4 layer held to
// 25% is not painted red for a 10% its rule accepts; rows no rule watches are grey. Ratio metrics (the catalogue's
// is_ratio) are drawn on a log scale. Without any rule on the metric: a sequential scale, reversed where the catalogue
// says low is worse (cosine, SQNR) so that bad always looks hot.

export const BELOW = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
export const ABOVE = [[254, 217, 118], [253, 141, 60], [227, 26, 28], [128, 0, 38]];
export const SEQUENTIAL = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
const GREY = [[238, 238, 238], [48, 48, 48]];
export const NONFINITE = [209, 0, 209];
export const HATCH_DARK = [205, 210, 218];
export const HATCH_LIGHT = [238, 240, 243];

export function ramp(stops, t) {
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
export function makeScale(metric, values, bounds) {
  const { lo, hi, pos } = scalePosition(metric, valueRange(values), bounds.map((b) => b.threshold));
  const reverse = lowerIsWorse(metric);
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
