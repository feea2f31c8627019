// DOM and canvas helpers shared by the panels.
export const $ = (id) => document.getElementById(id);

export function setupCanvas(canvas, cssWidth, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.round(cssWidth * dpr);
  canvas.height = Math.round(cssHeight * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return { ctx, dpr, width: cssWidth, height: cssHeight };
}

export function showOverlay(id, text) {
  const el = $(id);
  if (text) {
    el.textContent = text;
    el.hidden = false;
  } else {
    el.hidden = true;
  }
}

export function placeTooltip(tooltip, wrap, x, y) {
  tooltip.hidden = false;
  const w = tooltip.offsetWidth;
  const h = tooltip.offsetHeight;
  let left = x + 14;
  let top = y + 14;
  if (left + w > wrap.clientWidth) left = Math.max(0, x - w - 14);
  if (top + h > wrap.clientHeight) top = Math.max(0, y - h - 14);
  tooltip.style.left = `${left}px`;
  tooltip.style.top = `${top}px`;
}

export function ellipsizeLeft(ctx, text, maxWidth) {
  if (ctx.measureText(text).width <= maxWidth) return text;
  let lo = 0;
  let hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (ctx.measureText("…" + text.slice(mid)).width <= maxWidth) hi = mid;
    else lo = mid + 1;
  }
  return "…" + text.slice(lo);
}
