// Small helpers every part of the dashboard shares: the operator key, the data routes,
// and building DOM from server values (always as text: textContent, never HTML).

export const KEY = "onceflow.operatorKey";
export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];

export function hasKey() {
  return Boolean(sessionStorage.getItem(KEY));
}

export function authHeaders() {
  return { Authorization: "Bearer " + sessionStorage.getItem(KEY) };
}

/** An element with its class and text (the text set with textContent). */
export function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

/** A table cell with ``text`` appended to ``row``; ``key`` becomes its data-k. */
export function cell(row, text, cls, key) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  if (key) td.dataset.k = key;
  row.appendChild(td);
  return td;
}

/** Replace ``tbody``'s rows with one per item, each made by ``build(tr, item)``. */
export function fill(tbody, items, build) {
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    build(tr, item);
    return tr;
  });
  tbody.replaceChildren(...rows);
}

/** Like :func:`fill`, but a row whose ``keyOf(item)`` is already in ``tbody`` is kept (its
 * buttons with it: a click under way is not lost) and only passed to ``update(tr, item)``;
 * rows are moved only where the order changed. */
export function fillKeyed(tbody, items, keyOf, build, update) {
  const old = new Map([...tbody.children].map((tr) => [tr.dataset.rowKey, tr]));
  const rows = items.map((item) => {
    const key = keyOf(item);
    let tr = old.get(key);
    if (tr) {
      old.delete(key);
      if (update) update(tr, item);
    } else {
      tr = document.createElement("tr");
      tr.dataset.rowKey = key;
      build(tr, item);
    }
    return tr;
  });
  for (const tr of old.values()) tr.remove();
  rows.forEach((tr, i) => {
    const at = tbody.children[i] || null;
    if (at !== tr) tbody.insertBefore(tr, at);
  });
}

export function ageText(seconds) {
  if (seconds < 60) return seconds.toFixed(1) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

/** A database time (ISO 8601) as shown: date and time to the millisecond, UTC. */
export function timeText(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return d.toISOString().replace("T", " ").replace("Z", " UTC");
}

export async function errorText(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return body.error.message;
    if (typeof body.detail === "string") return body.detail;
    if (Array.isArray(body.detail) && body.detail.length) return body.detail[0].msg || response.statusText;
    return body.message || response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

/** A problem reading a data route: its HTTP status and the server's message. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** GET a data route with the operator key; the JSON answer, or an ApiError. */
export async function getJson(path, signal) {
  const response = await fetch(path, { headers: authHeaders(), cache: "no-store", signal });
  if (!response.ok) throw new ApiError(response.status, await errorText(response));
  return response.json();
}

/** A link to a request's page (a hash route: linkable, and the back button works). */
export function requestHref(requestId, workspaceId) {
  let href = "#/requests/" + encodeURIComponent(requestId);
  if (workspaceId) href += "?ws=" + encodeURIComponent(workspaceId);
  return href;
}

export function requestLink(requestId, workspaceId, text) {
  const a = el("a", "id", text === undefined ? requestId : text);
  a.href = requestHref(requestId, workspaceId);
  a.title = requestId;
  return a;
}

/** A whole number with thousands separators, or the value as given when it is not one. */
export function num(value) {
  if (value === null || value === undefined || value === "") return "";
  const n = Number(value);
  if (!Number.isFinite(n)) return String(value);
  return Number.isInteger(n) ? n.toLocaleString("en-US") : String(value);
}
