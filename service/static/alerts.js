// The alerts table of the open run.
import { api, ApiError, listOf, pick } from "./api.js";
import { describeError } from "./banner.js";
import { $ } from "./dom.js";
import { formatTime, formatValue, toNumber } from "./format.js";
import { metricsOf } from "./runs.js";
import { hashFor, state } from "./state.js";

// Each load counts up; an answer that arrives after a newer request started is dropped.
let alertsSeq = 0;

// The step an alert is about: where it fired (or went pending), else its latest transition.
function alertStep(alert) {
  const firing = pick(alert, "firing");
  const pending = pick(alert, "pending");
  return pick(firing, "step") ?? pick(pending, "step") ?? pick(alert, "step");
}

function alertTime(alert) {
  const firing = pick(alert, "firing");
  const pending = pick(alert, "pending");
  return pick(firing, "time") ?? pick(pending, "time");
}

export async function loadAlerts() {
  const seq = ++alertsSeq;
  let body;
  try {
    body = await api("/alerts", { run: state.run, state: state.alertState });
  } catch (err) {
    if (seq !== alertsSeq) return;
    $("alerts-body").innerHTML = "";
    const empty = $("alerts-empty");
    empty.textContent =
      err instanceof ApiError && err.status === 404 && !err.detail
        ? "This collector does not serve alerts."
        : `Could not load alerts: ${describeError(err)}`;
    empty.hidden = false;
    return;
  }
  if (seq !== alertsSeq) return;
  const alerts = listOf(body, "alerts");
  const tbody = $("alerts-body");
  tbody.innerHTML = "";
  const empty = $("alerts-empty");
  empty.hidden = alerts.length > 0;
  empty.textContent = state.alertState
    ? `No ${state.alertState} alerts for this run.`
    : "No alerts for this run. Rules are evaluated as points arrive.";
  for (const alert of alerts) {
    const tr = document.createElement("tr");
    const s = String(pick(alert, "state") || "");
    const layer = pick(alert, "layer");
    const metric = pick(pick(alert, "labels") || {}, "metric");
    const step = alertStep(alert);
    const cell = (content, cls) => {
      const td = document.createElement("td");
      if (cls) td.className = cls;
      if (content instanceof Node) td.append(content);
      else td.textContent = content === null ? "—" : String(content);
      tr.append(td);
    };
    const badge = document.createElement("span");
    badge.className = `state ${s}`;
    badge.textContent = s || "?";
    cell(badge);
    cell(pick(alert, "rule"));
    cell(layer);
    cell(metric);
    if (step !== null) {
      const a = document.createElement("a");
      // Scalar rules (no layer) only move the step marker; layer rules also select their layer and metric.
      const target = { step };
      if (layer) target.layer = layer;
      if (layer && metricsOf(state.detail).includes(metric)) target.metric = metric;
      a.href = "#" + hashFor(target);
      a.textContent = String(step);
      a.title = layer ? `Select ${layer} at step ${step}` : `Mark step ${step}`;
      cell(a, "num");
    } else {
      cell(null);
    }
    cell(formatValue(toNumber(pick(alert, "value")), metric), "num");
    cell(pick(pick(alert, "annotations") || {}, "summary"));
    cell(formatTime(alertTime(alert)));
    tbody.append(tr);
  }
}
