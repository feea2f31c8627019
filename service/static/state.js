// What the page shows, in one object, and its mirror in the URL hash (#run=...&metric=...&layer=...&step=...&start=...
// &end=...&agg=...&rank=...), so every view can be linked to and the browser's back button works.

export const state = {
  runs: [],
  runsLoaded: false, // whether the collector has listed the runs (an unanswered list is not an empty one)
  authNeeded: false, // the last answer was 401 or 403: the page waits for a token
  run: null, // selected run name
  detail: null, // GET /runs/{run}
  metric: null,
  agg: "worst", // bucket aggregate: "worst" is max, or min where a high value is good (cosine, SQNR)
  glob: "",
  start: null,
  end: null,
  layer: null,
  step: null,
  rank: null, // null: the collector's default (rank 0); a rank; or "all" (ranks.js)
  alertState: "",
  rules: [], // GET /rules: the alert rules, whose bounds the heatmap and the charts draw
  formats: new Map(), // GET /runs/{run}/layers: layer name → its current format per tensor kind (unknown: absent)
  heatmap: null, // last heatmap answer plus derived colours
  series: null, // the layer history: one series per rank shown
  rankView: null, // GET /runs/{run}/steps/{step}: the layers × ranks view
  loss: null,
  actions: [], // GET /actions?run=: what the agent did to the training job, drawn on the charts
};

export function readHash() {
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
    rank: p.get("rank") === "all" ? "all" : num("rank"),
  };
}

export function hashFor(changes) {
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

export function setHash(changes) {
  location.hash = hashFor(changes);
}
