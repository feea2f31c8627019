// The REST client: GET requests to the collector's public API (/api/v1/...) with the token the user entered, errors
// as ApiError from RFC 9457 problem+json.

const API = "api/v1";
export const TOKEN_KEY = "quantwatch.token";

// Called with the ApiError of every 401 or 403 answer (the banner's token prompt; set by main.js).
let authProblem = () => {};

export function onAuthProblem(handler) {
  authProblem = handler;
}

export class ApiError extends Error {
  constructor(status, title, detail, path) {
    super(`${status} ${title}${detail ? ": " + detail : ""}`);
    this.status = status;
    this.title = title;
    this.detail = detail;
    this.path = path;
  }
}

export async function api(path, params) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== null && v !== undefined && v !== "") query.set(k, String(v));
  }
  const url = `${API}${path}${query.toString() ? "?" + query : ""}`;
  const headers = { Accept: "application/json" };
  const token = localStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(url, { headers });
  } catch (err) {
    throw new ApiError(0, "collector unreachable", String(err.message || err), url);
  }
  if (!response.ok) {
    let title = response.statusText || "error";
    let detail = "";
    try {
      const problem = await response.json(); // RFC 9457 problem+json
      title = problem.title || title;
      detail = problem.detail || "";
    } catch (_) {
      // Not JSON: keep the status line.
    }
    const err = new ApiError(response.status, title, detail, url);
    if (response.status === 401 || response.status === 403) authProblem(err);
    throw err;
  }
  return response.json();
}

export function listOf(body, key) {
  if (Array.isArray(body)) return body;
  if (body && Array.isArray(body[key])) return body[key];
  if (body && Array.isArray(body.items)) return body.items;
  return [];
}

export function pick(obj, ...names) {
  for (const n of names) {
    if (obj && obj[n] !== undefined && obj[n] !== null) return obj[n];
  }
  return null;
}
