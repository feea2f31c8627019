// What the agent did to the training job (GET /actions?run=: a layer kept in higher precision, a checkpoint
// saved, training stopped), drawn as annotations on the layer and loss charts at the step it was taken after.
import { api, ApiError } from "./api.js";
import { state } from "./state.js";

let actionsSeq = 0;

// Load the run's actions into state.actions; false when a newer load started meanwhile.
export async function loadActions() {
  const seq = ++actionsSeq;
  let actions = [];
  try {
    actions = await api("/actions", { run: state.run });
  } catch (err) {
    // A collector from before the actions route answers 404: no annotations then. Anything else is shown.
    if (!(err instanceof ApiError && err.status === 404)) throw err;
  }
  if (seq !== actionsSeq) return false;
  state.actions = actions;
  return true;
}

// The annotations of a chart: the run-wide actions and those of `layer` (null: every action), one per step and what.
export function annotationsFor(layer) {
  const seen = new Map();
  for (const action of state.actions || []) {
    if (layer !== null && action.layer && action.layer !== layer) continue;
    const label = action.layer ? `${action.action} ${action.layer}` : action.action;
    seen.set(`${action.step} ${label}`, { step: action.step, label, detail: action.detail });
  }
  return [...seen.values()];
}
