// The rank selector's choice (state.rank: null for the collector's default rank 0, a rank, or "all") and what the
// heatmap and the layer history read for it. "all" reads every rank on one step grid; a heatmap cell then shows the
// worst rank's value (non-finite first, else the highest, or the lowest where low is worse) and remembers that rank.
import { api, pick } from "./api.js";
import { toNumber } from "./format.js";
import { state } from "./state.js";

export const ALL = "all";
// One colour per rank in the layer history when every rank is drawn (repeats past eight ranks).
export const RANK_COLOURS = ["#2f6fd6", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#0b7285", "#e67700", "#495057"];

export function runRanks() {
  const ranks = pick(state.detail, "ranks");
  return Array.isArray(ranks) ? ranks.slice().sort((a, b) => a - b) : [];
}

// The ranks the panels read: every rank of the run for "all", else the selected one (null: the collector's default).
export function shownRanks() {
  return state.rank === ALL ? runRanks() : [state.rank];
}

function worse(a, b, lowerWorse) {
  if (b === null) return false;
  if (a === null) return true;
  if (!Number.isFinite(b)) return Number.isFinite(a);
  if (!Number.isFinite(a)) return false;
  return lowerWorse ? b < a : b > a;
}

// Per-rank heatmap answers on one step grid → one answer whose cells hold the worst rank's value; `worst_rank[r][c]`
// is the rank it came from (null where no rank measured the cell).
export function worstOfRanks(bodies, ranks, lowerWorse) {
  const withSteps = bodies.map((body, k) => ({ body, rank: ranks[k] })).filter((x) => (x.body.steps || []).length);
  if (!withSteps.length) return { ...bodies[0], worst_rank: [] };
  const grid = withSteps[0].body;
  const values = grid.layers.map(() => grid.steps.map(() => null));
  const worstRank = grid.layers.map(() => grid.steps.map(() => null));
  for (const { body, rank } of withSteps) {
    body.layers.forEach((_, r) => {
      body.values[r].forEach((raw, c) => {
        if (raw !== null && worse(toNumber(values[r][c]), toNumber(raw), lowerWorse)) {
          values[r][c] = raw;
          worstRank[r][c] = rank;
        }
      });
    });
  }
  return { ...grid, values, worst_rank: worstRank };
}

// The heatmap answer for the selection; every rank is asked over the same step range so that their grids align.
export async function heatmapForRanks(path, params, lowerWorse) {
  if (state.rank !== ALL) return api(path, { ...params, rank: state.rank });
  const ranks = runRanks();
  const range = { start: params.start ?? pick(state.detail, "first_step"), end: params.end ?? pick(state.detail, "last_step") };
  const bodies = await Promise.all(ranks.map((rank) => api(path, { ...params, ...range, rank })));
  return worstOfRanks(bodies, ranks, lowerWorse);
}
