// The collector's alert rules as the page sees them: glob matching, breach tests and the bounds of a layer.
import { lowerIsWorse } from "./catalog.js";
import { state } from "./state.js";

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

export function globMatches(glob, name) {
  return globRegExp(glob).test(name);
}

// A breach of `op threshold` as the collector decides it: on the float32 value (the API spells float32 values in
// their shortest form: 0.95 stands for 0.949999988…, which is < 0.95), and non-finite values breach every rule.
// ">" and ">=" say high values are bad, "<" and "<=" low ones.
export function breaches(bound, value) {
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

export function lowIsBad(bound) {
  return bound.op === "<" || bound.op === "<=";
}

// Whether a rule's format globs take a layer of `formats` ({kind: format}, null or empty: unknown), as the collector
// decides it: any kind's format may match unless `format_kind` names the kind; a layer of unknown format matches no
// `formats:` rule and is not excluded by an `exclude_formats:` one.
function anyFormat(formats, globs, kind) {
  const values = kind ? (kind in formats ? [formats[kind]] : []) : Object.values(formats);
  return values.some((value) => globs.some((g) => globMatches(g, value)));
}

export function selectsFormats(rule, formats) {
  const known = formats && Object.keys(formats).length > 0;
  const kind = rule.format_kind || null;
  if (Array.isArray(rule.formats) && (!known || !anyFormat(formats, rule.formats, kind))) return false;
  return !(Array.isArray(rule.exclude_formats) && known && anyFormat(formats, rule.exclude_formats, kind));
}

// The enabled rules on `metric` that apply to the open run and to `layer` (its name and its formats), one entry per
// distinct (op, threshold).
export function ruleBounds(metric, layer) {
  const bounds = new Map();
  for (const rule of state.rules) {
    if (!rule.enabled || rule.metric !== metric || !globMatches(rule.runs || "*", state.run || "")) continue;
    // A baseline rule's bound is relative to each series' start: it draws no fixed line.
    if (rule.baseline) continue;
    const globs = Array.isArray(rule.layers) ? rule.layers : [rule.layers || "*"];
    if (!globs.some((g) => globMatches(g, layer))) continue;
    if (!selectsFormats(rule, state.formats.get(layer))) continue;
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
  const wantLow = lowerIsWorse(metric);
  const sameWay = bounds.filter((b) => lowIsBad(b) === wantLow);
  const pool = sameWay.length ? sameWay : bounds;
  const low = lowIsBad(pool[0]);
  return pool.filter((b) => lowIsBad(b) === low).reduce((a, b) => ((low ? b.threshold > a.threshold : b.threshold < a.threshold) ? b : a));
}

// Each row (layer) against its own rule bound, and the legend's entries: one per distinct bound, the most common
// first, with how many rows it colours; `unwatched` when some rows have no rule while others do.
export function rowBounds(metric, layers) {
  const bounds = layers.map((layer) => rowBound(metric, layer));
  const tally = new Map();
  for (const b of bounds) {
    if (!b) continue;
    const key = `${b.op} ${b.threshold}`;
    const seen = tally.get(key);
    if (seen) seen.rows++;
    else tally.set(key, { bound: b, rows: 1 });
  }
  const legend = [...tally.values()].sort((a, b) => b.rows - a.rows);
  return { bounds, legend, unwatched: legend.length > 0 && bounds.includes(null) };
}
