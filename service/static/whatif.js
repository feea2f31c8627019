// The what-if table of the selected layer: the error its weight, input and gradient would have under each candidate
// format (GET /runs/{run}/whatif?layer=), one row per candidate, cheapest first.
import { api, listOf, pick } from "./api.js";
import { describeError } from "./banner.js";
import { $ } from "./dom.js";
import { formatValue, toNumber } from "./format.js";
import { state } from "./state.js";

const KINDS = ["weight", "input", "grad"];

// Each load counts up; an answer that arrives after a newer request started is dropped.
let whatifSeq = 0;

function show(text) {
  $("whatif-body").innerHTML = "";
  const empty = $("whatif-empty");
  empty.textContent = text;
  empty.hidden = !text;
}

// One row per candidate: bits, then per kind its rel_l2 (and the underflow share, when any value flushed to zero).
function rowsOf(entries) {
  const rows = new Map();
  for (const e of entries) {
    const candidate = String(pick(e, "candidate"));
    if (!rows.has(candidate)) rows.set(candidate, { candidate, bits: pick(e, "bits"), own: [], kinds: {} });
    const row = rows.get(candidate);
    row.kinds[pick(e, "kind")] = e;
    if (pick(e, "own")) row.own.push(pick(e, "kind"));
  }
  return [...rows.values()].sort((a, b) => (a.bits ?? 99) - (b.bits ?? 99) || a.candidate.localeCompare(b.candidate));
}

function figure(entry) {
  if (!entry) return "—";
  const rel = formatValue(toNumber(pick(entry, "rel_l2")), "rel_l2");
  const underflow = toNumber(pick(entry, "underflow_ratio"));
  return underflow ? `${rel} · ${Number((underflow * 100).toPrecision(2))}% underflow` : rel;
}

export async function loadWhatif() {
  const seq = ++whatifSeq;
  $("whatif-title").textContent = state.layer ? `What-if formats: ${state.layer}` : "What-if formats";
  if (!state.layer) {
    show("Select a layer (click a heatmap cell) to compare its error under other formats.");
    return;
  }
  let body;
  try {
    body = await api(`/runs/${encodeURIComponent(state.run)}/whatif`, { layer: state.layer, rank: state.rank });
  } catch (err) {
    if (seq === whatifSeq) show(`Could not load the what-if statistics: ${describeError(err)}`);
    return;
  }
  if (seq !== whatifSeq) return;
  const entries = listOf(body, "entries");
  $("whatif-step").textContent = pick(body, "step") === null ? "" : `step ${pick(body, "step")}`;
  if (!entries.length) {
    show("No what-if statistics for this layer (the agent measures them every whatif_every-th sampled step).");
    return;
  }
  show("");
  const tbody = $("whatif-body");
  for (const row of rowsOf(entries)) {
    const tr = document.createElement("tr");
    tr.dataset.candidate = row.candidate;
    const cells = [row.candidate + (row.own.length ? " (own)" : ""), row.bits ?? "—", ...KINDS.map((k) => figure(row.kinds[k]))];
    for (const [i, text] of cells.entries()) {
      const td = document.createElement("td");
      if (i > 0) td.className = "num";
      td.textContent = String(text);
      tr.append(td);
    }
    tbody.append(tr);
  }
}
