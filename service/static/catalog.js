// The collector's catalogue of metrics and scalars (GET /api/v1/catalog, read from quantwatch.protocol): which
// direction of a figure is the bad one, which figures are ratios, and what each one means. The page keeps no list of
// its own; a metric the catalogue does not name (a custom one) is taken as higher-is-worse and not a ratio.
import { api, listOf } from "./api.js";

const measures = new Map();
let loaded = false;

// Reads the catalogue once; true when this call loaded it (the panels drawn before then redraw with it). A failure
// (no token yet) leaves it to the next call.
export async function loadCatalog() {
  if (loaded) return false;
  let body;
  try {
    body = await api("/catalog");
  } catch (_) {
    return false;
  }
  for (const measure of [...listOf(body, "metrics"), ...listOf(body, "scalars")]) measures.set(measure.name, measure);
  loaded = true;
  return true;
}

export function lowerIsWorse(metric) {
  const measure = measures.get(metric);
  return measure !== undefined && measure.polarity === "lower_is_worse";
}

export function isRatioMetric(metric) {
  const measure = measures.get(metric);
  return measure !== undefined && measure.is_ratio === true;
}

// "meaning (formula)" for the metric picker's tooltip; "" for a metric the catalogue does not name.
export function describeMetric(metric) {
  const measure = measures.get(metric);
  if (measure === undefined) return "";
  return measure.formula ? `${measure.meaning} (${measure.formula})` : measure.meaning;
}
