// The request list: GET /dashboard/api/requests with the form's filters, newest first,
// paged by the server's cursor ("Older"). A request id or job id pasted into the search box
// is looked up: exactly one request found opens its page.

import { $, ApiError, cell, fill, getJson, hasKey, requestHref, requestLink, timeText } from "./util.js";

const FIELDS = ["q", "workspace", "job", "branch", "stage", "worker_class", "status", "time"];
let pages = [];        // the cursors of the pages shown so far ("" for the first)
let current = null;    // the filters of the list shown
let inFlight = null;   // aborts a search overtaken by another
let openNext = false;
let lastLoad = 0;      // performance.now() of the last read
const REFRESH_MS = 5000;  // the operator submitted the form: a single match opens its page

/** The form's filters (only those set), as the hash route and the API take them. */
function formFilters() {
  const form = $("#search-form");
  const out = {};
  for (const name of FIELDS) {
    const value = form.elements[name].value.trim();
    if (value) out[name] = value;
  }
  return out;
}

function setForm(filters) {
  const form = $("#search-form");
  for (const name of FIELDS) form.elements[name].value = filters[name] || "";
}

/** The API's query for ``filters`` (the time filter becomes ``since``, on this clock). */
function apiQuery(filters, cursor) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) {
    if (k === "time") query.set("since", new Date(Date.now() - Number(v) * 1000).toISOString());
    else query.set(k, v);
  }
  if (!query.has("limit")) query.set("limit", "50");  // a link may ask for smaller pages
  if (cursor) query.set("cursor", cursor);
  return query;
}

/** Show the list for ``filters`` (from the hash route), from its first page. */
export function showSearch(filters) {
  const open = openNext;  // only a submit opens: the back button returns to the list
  openNext = false;
  setForm(filters);
  current = filters;
  pages = [""];
  return load("", open);
}

/** Read the list again at the page shown (the overview keeps it live), at most every
 * REFRESH_MS: a busy queue changes every snapshot, the list need not follow each one. */
export function refreshSearch() {
  if (current === null) return showSearch({});
  if (pages.length > 1) return null;  // an older page stays as the operator paged to it
  if (performance.now() - lastLoad < REFRESH_MS) return null;
  return load("", false);
}

async function load(cursor, open) {
  if (!hasKey() || $("#panels").hidden) return;  // no key, or refused: nothing to read
  lastLoad = performance.now();
  if (inFlight) inFlight.abort();
  const mine = (inFlight = new AbortController());
  const note = $("#search-note");
  try {
    const page = await getJson("/dashboard/api/requests?" + apiQuery(current, cursor), mine.signal);
    if (mine !== inFlight) return;
    // A pasted id that names exactly one request opens it.
    if (open && current.q && page.items.length === 1 && !page.next) {
      const [only] = page.items;
      location.hash = requestHref(only.request_id, only.workspace_id);
      return;
    }
    render(page);
    const down = page.shards_unavailable || [];
    let text = `${page.items.length} shown` + (page.next ? ", more below" : "");
    if (pages.length > 1) text += ` (page ${pages.length})`;
    if (!page.items.length) text = current.q ? `nothing found for ${current.q}` : "no requests match";
    if (down.length) text += `; shard(s) ${down.join(", ")} not answering`;
    note.textContent = text;
    const next = $("#next-page");
    next.disabled = !page.next;
    next.dataset.cursor = page.next || "";
  } catch (err) {
    if (err.name === "AbortError") return;
    note.textContent = err instanceof ApiError && err.status === 404
      ? "search is not available on this server"
      : "unavailable: " + err.message;
    fill($("#results tbody"), [], () => {});
  }
}

function render(page) {
  fill($("#results tbody"), page.items, (tr, r) => {
    tr.dataset.requestId = r.request_id;
    cell(tr, "", "id").appendChild(requestLink(r.request_id, r.workspace_id));
    cell(tr, r.workspace_id);
    cell(tr, r.job_id);
    cell(tr, r.branch_path);
    cell(tr, r.stage);
    cell(tr, r.worker_class);
    cell(tr, r.status, "status " + r.status);
    cell(tr, r.attempts, "num");
    cell(tr, timeText(r.created_at));
    cell(tr, timeText(r.finished_at));
  });
}

/** Wire the form: a search is a hash route (#/requests?…), so it is linkable. */
export function setUpSearch() {
  const form = $("#search-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const filters = formFilters();
    const target = "#/requests" + (Object.keys(filters).length ? "?" + new URLSearchParams(filters) : "");
    openNext = true;
    if (location.hash === target) showSearch(filters);
    else location.hash = target;
  });
  form.addEventListener("reset", () => {
    setTimeout(() => form.requestSubmit(), 0);  // after the fields are cleared
  });
  $("#next-page").addEventListener("click", () => {
    const next = $("#next-page");
    const cursor = next.dataset.cursor;
    if (!cursor) return;
    // One page per cursor: a second click before the page arrives does not skip one.
    next.disabled = true;
    next.dataset.cursor = "";
    pages.push(cursor);
    load(cursor, false);
  });
  $("#first-page").addEventListener("click", () => {
    pages = [""];
    load("", false);
  });
}
