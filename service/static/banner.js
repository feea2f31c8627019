// The banner at the top of the page: errors of the loaders and the token prompt.
import { ApiError } from "./api.js";
import { $ } from "./dom.js";

// `source` says which loader raised the banner, so a later success of that loader (and only that one) clears it.
export function showBanner(text, source) {
  $("banner-text").textContent = text;
  $("banner").dataset.source = source;
  $("banner").hidden = false;
}

export function clearBanner(source) {
  if (source && $("banner").dataset.source !== source) return;
  $("banner").hidden = true;
  $("token-form").hidden = true;
}

export function showAuthProblem(err) {
  showBanner(
    err.status === 401
      ? "This collector needs a token with the read scope (401 Unauthorized)."
      : "The token in use lacks the read scope (403 Forbidden).",
    "auth",
  );
  $("token-form").hidden = false;
}

export function describeError(err) {
  if (err instanceof ApiError) {
    if (err.status === 0) return `Cannot reach the collector (${err.detail}).`;
    return `${err.status} ${err.title}${err.detail ? " — " + err.detail : ""}`;
  }
  return String(err);
}
