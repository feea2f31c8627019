// The runs list, the open run's facts and pickers, and the alert rules the panels draw.
import { api, ApiError, listOf, pick } from "./api.js";
import { clearBanner, describeError, showBanner } from "./banner.js";
import { describeMetric } from "./catalog.js";
import { $ } from "./dom.js";
import { formatTime } from "./format.js";
import { ALL, runRanks } from "./ranks.js";
import { state } from "./state.js";

export async function loadRuns() {
  let body;
  try {
    body = await api("/runs");
  } catch (err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
      state.authNeeded = true;
      renderRuns();
    } else {
      showBanner(`Could not list runs: ${describeError(err)}`, "runs");
    }
    return false;
  }
  state.authNeeded = false;
  clearBanner("runs");
  clearBanner("auth");
  state.runsLoaded = true;
  // Most recently active first.
  state.runs = listOf(body, "runs")
    .slice()
    .sort((a, b) => (pick(b, "last_seen_at") ?? 0) - (pick(a, "last_seen_at") ?? 0));
  renderRuns();
  return true;
}

export function runName(run) {
  return typeof run === "string" ? run : pick(run, "name", "run");
}

export function renderRuns() {
  const list = $("runs-list");
  list.innerHTML = "";
  // "No runs yet" only once the collector has answered: a collector that wants a token has not said so.
  $("runs-empty").hidden = !state.runsLoaded || state.runs.length > 0;
  $("runs-locked").hidden = state.runsLoaded || !state.authNeeded;
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

export function metricsOf(detail) {
  const raw = pick(detail, "metrics", "metrics_seen") || [];
  return raw.map((m) => (typeof m === "string" ? m : pick(m, "name", "metric"))).filter(Boolean);
}

// The alert rules; kept as they were when the collector cannot answer (the alerts panel reports its errors).
// True when they changed.
export async function loadRules() {
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

// Each layer's current formats, as {kind: format} with the kinds it declared; a collector that cannot answer leaves the
// formats unknown (then no `formats:` rule selects a layer, as in the collector).
function formatsOf(layers) {
  const formats = new Map();
  for (const layer of listOf(layers, "layers")) {
    const declared = Object.entries(pick(layer, "formats") || {}).filter(([, format]) => typeof format === "string");
    if (declared.length) formats.set(layer.name, Object.fromEntries(declared));
  }
  return formats;
}

export async function loadRunDetail() {
  const run = encodeURIComponent(state.run);
  try {
    const [detail, layers] = await Promise.all([api(`/runs/${run}`), api(`/runs/${run}/layers`).catch(() => [])]);
    state.detail = detail;
    state.formats = formatsOf(layers);
  } catch (err) {
    state.detail = null;
    state.formats = new Map();
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
  // A count, with the ranks' numbers where they are not just rank 0: "1 rank", "4 ranks (0, 1, 2, 3)".
  if (Array.isArray(ranks)) {
    const count = `${ranks.length} rank${ranks.length === 1 ? "" : "s"}`;
    add("ranks", ranks.length === 1 && ranks[0] === 0 ? count : `${count} (${ranks.join(", ")})`);
  }
  renderRankPicker(runRanks());
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
    opt.title = describeMetric(m);
    select.append(opt);
  }
  if (!state.metric || !metrics.includes(state.metric)) {
    state.metric = metrics.includes("output_rel_l2") ? "output_rel_l2" : metrics[0] || null;
  }
  select.value = state.metric || "";
}

// A rank picker ("all", then each rank) only when there is more than one rank to pick from; a single-rank run shows
// none, and an "all" or a rank in the URL that the run does not have falls back to the default.
function renderRankPicker(ranks) {
  const select = $("rank");
  select.innerHTML = "";
  for (const r of [ALL, ...ranks]) {
    const opt = document.createElement("option");
    opt.value = String(r);
    opt.textContent = r === ALL ? "all (worst)" : String(r);
    select.append(opt);
  }
  $("rank-label").hidden = ranks.length < 2;
  if (state.rank !== null && (ranks.length < 2 || !(state.rank === ALL || ranks.includes(state.rank)))) state.rank = null;
  select.value = String(state.rank ?? (ranks.includes(0) ? 0 : ranks[0] ?? ""));
}
