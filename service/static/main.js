// QuantWatch web view: plain JavaScript modules over the public REST API (/api/v1/...); no build step, no
// dependencies. This module wires the panels to the URL hash, the controls and the live refresh.
import { loadActions } from "./actions.js";
import { loadAlerts } from "./alerts.js";
import { onAuthProblem, pick, TOKEN_KEY } from "./api.js";
import { clearBanner, showAuthProblem } from "./banner.js";
import { loadCatalog } from "./catalog.js";
import { mountChart } from "./chart.js";
import { $ } from "./dom.js";
import { drawHeatmap, installHeatmapEvents, loadHeatmap } from "./heatmap.js";
import { globMatches } from "./rules.js";
import { ALL } from "./ranks.js";
import { drawRankView, installRankViewEvents, loadRankView } from "./rankview.js";
import { loadRules, loadRunDetail, loadRuns, renderRuns, runName } from "./runs.js";
import { drawLoss, drawSeries, loadLoss, loadSeries } from "./series.js";
import { readHash, setHash, state } from "./state.js";
import { loadWhatif } from "./whatif.js";

const LIVE_INTERVAL_MS = 5000;

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
  const rankViewChanged = runChanged || stepChanged || h.metric !== state.metric;
  const rowChanged = h.layer !== state.layer || h.rank !== state.rank;
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
  if (seriesChanged) loadWhatif();
  if (runChanged || heatmapChanged) loadLoss();
  else if (stepChanged) drawLoss();
  if (runChanged) loadAlerts();
  if (runChanged) redrawWithActions();
  if (rankViewChanged) loadRankView();
  else if (rowChanged) drawRankView();
}

// The charts drawn again once the run's actions are in (they are drawn without them until then).
async function redrawWithActions() {
  try {
    if (!(await loadActions())) return;
  } catch (_) {
    return; // the other panels of the run say what the collector answered
  }
  drawSeries();
  drawLoss();
}

// Live refresh: poll the runs list; reload the selected run's panels only when it has new points.

async function refresh(force) {
  const before = state.runs.find((r) => runName(r) === state.run);
  const beforeKey = before ? JSON.stringify([pick(before, "last_seen_at"), pick(before, "points"), pick(before, "firing_alerts")]) : null;
  if (!(await loadRuns())) return;
  // The catalogue and the rules before any run opens: a token entered just now may be the first that reads them.
  const [rulesChanged, catalogLoaded] = await Promise.all([loadRules(), loadCatalog()]);
  if (!state.run) {
    openLatestRun();
    return;
  }
  const after = state.runs.find((r) => runName(r) === state.run);
  const afterKey = after ? JSON.stringify([pick(after, "last_seen_at"), pick(after, "points"), pick(after, "firing_alerts")]) : null;
  if (force || catalogLoaded || beforeKey !== afterKey) {
    if (!(await loadRunDetail())) return;
    loadHeatmap();
    loadSeries();
    loadLoss();
    loadAlerts();
    redrawWithActions();
    loadRankView();
    loadWhatif();
  } else if (rulesChanged) {
    loadHeatmap();
    drawSeries();
    drawRankView();
  }
}

function installControls() {
  $("metric").addEventListener("change", (e) => setHash({ metric: e.target.value }));
  $("agg").addEventListener("change", (e) => setHash({ agg: e.target.value }));
  $("rank").addEventListener("change", (e) => setHash({ rank: e.target.value === ALL ? ALL : Number(e.target.value) }));
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
  document.querySelectorAll(".chart-wrap[data-chart]").forEach(mountChart);
  onAuthProblem(showAuthProblem);
  installControls();
  installHeatmapEvents();
  installRankViewEvents();
  await Promise.all([loadRuns(), loadRules(), loadCatalog()]);
  if (!openLatestRun()) applyHash();
}

// The collector's rule glob matcher, for the console and the browser test that checks it against Python's fnmatch.
window.globMatches = globMatches;
start();
