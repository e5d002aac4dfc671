// onceflow dashboard: reads /dashboard/api/stream (Server-Sent Events over fetch, since
// EventSource cannot send an Authorization header) and renders each snapshot in place; the
// history charts, the request list and a request's page read their own routes. Views are
// hash routes (#/, #/requests?filters, #/requests/<id>?ws=<workspace>): linkable, and the
// back button works. The operator key lives in sessionStorage (this tab only) and is only
// ever sent as "Authorization: Bearer <key>". Every value from the server is set as text.

import { loadSpend, renderSnapshot, tick, workerClasses } from "./overview.js";
import { refreshRequest, showRequest } from "./request.js";
import { refreshSearch, setUpSearch, showSearch } from "./search.js";
import { offerClasses, refreshSeries, setUpSeries } from "./series.js";
import { $, KEY, errorText, hasKey, authHeaders } from "./util.js";

let controller = null;   // aborts the current stream
let backoff = 1000;      // reconnect delay after an error, doubled up to 30 s
let retryTimer = null;
let received = 0;        // performance.now() when the last snapshot arrived
let snapshots = 0;
let routed = null;       // the hash the view was last built for

function setState(state, text) {
  document.body.dataset.state = state;
  $("#conn-state").textContent = text;
}

function refuse(text) {
  const p = $("#refusal");
  p.textContent = text;
  p.hidden = false;
  $("#panels").hidden = true;
  setState("refused", "refused");
}

/** The view the hash names: {view, id?, ws?, filters?}. */
function parseHash() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, search = ""] = hash.split("?");
  const params = new URLSearchParams(search);
  let parts;
  try {
    parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  } catch (err) {
    return { view: "overview" };  // not a valid escape (#/requests/%): the landing page
  }
  if (parts[0] === "requests" && parts.length >= 2) {
    return { view: "request", id: parts.slice(1).join("/"), ws: params.get("ws") || "" };
  }
  if (parts[0] === "requests") return { view: "requests", filters: Object.fromEntries(params) };
  return { view: "overview" };
}

function route() {
  if (!hasKey() || $("#panels").hidden) return;  // nothing to show without data
  if (routed === location.hash) return;
  routed = location.hash;
  const r = parseHash();
  document.body.dataset.view = r.view;
  $("#view-overview").hidden = r.view === "request";
  $("#view-request").hidden = r.view !== "request";
  if (r.view === "request") {
    showRequest(r.id, r.ws);
  } else {
    showSearch(r.view === "requests" ? r.filters : {});
    refreshSeries(true);
  }
  window.scrollTo(0, 0);
}

function onSnapshot(s) {
  received = performance.now();
  $("#refusal").hidden = true;
  const first = snapshots === 0;
  $("#panels").hidden = false;
  setState("live", "live");
  renderSnapshot(s);
  offerClasses(workerClasses(s));
  backoff = 1000;  // drawn: the stream works, a later loss starts its waits anew
  delete document.body.dataset.drawError;
  document.body.dataset.snapshots = String(++snapshots);
  if (first) {
    loadSpend();
    routed = null;
    route();
    return;
  }
  // Live: the history and the first page of the list follow the snapshots; a request's
  // page is read again when something changed (a snapshot is only sent on a change).
  if (document.body.dataset.view === "request") refreshRequest();
  else {
    refreshSeries();
    refreshSearch();
  }
}

function handleEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length) return;
  try {
    if (event === "snapshot") onSnapshot(JSON.parse(data.join("\n")));
    else if (event === "problem") setState("retrying", JSON.parse(data.join("\n")).detail);
  } catch (err) {
    // An event that could not be read or drawn is not a lost stream: say so and keep
    // reading (the next snapshot draws the page again), rather than reconnect.
    document.body.dataset.drawError = err.message;
    $("#conn-state").textContent = `could not show the last update: ${err.message}`;
  }
}

async function connect() {
  clearTimeout(retryTimer);
  if (controller) controller.abort();
  if (!hasKey()) {
    setState("no-key", "enter an operator key");
    return;
  }
  controller = new AbortController();
  const mine = controller;
  setState("connecting", "connecting");
  try {
    const response = await fetch("/dashboard/api/stream", {
      headers: authHeaders(), signal: mine.signal, cache: "no-store",
    });
    if (response.status === 401 || response.status === 403) {
      sessionStorage.removeItem(KEY);
      refuse(`Refused (${response.status}): ${await errorText(response)}. Enter a valid operator key.`);
      return;
    }
    if (!response.ok) throw new Error(`${response.status} ${await errorText(response)}`);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the stream ended");
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        handleEvent(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
  } catch (err) {
    if (mine.signal.aborted) return;
    const wait = backoff;
    backoff = Math.min(backoff * 2, 30000);
    setState("retrying", `${err.message}: reconnecting in ${Math.round(wait / 1000)} s`);
    retryTimer = setTimeout(connect, wait);
  }
}

function start() {
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("#key").value.trim();
    $("#key").value = "";
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("#refusal").hidden = true;
    backoff = 1000;
    snapshots = 0;
    connect();
  });
  // Forgetting the key starts the page afresh: nothing it showed stays in the document, and
  // no timer or read of the old session keeps running.
  $("#forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    if (controller) controller.abort();
    location.reload();
  });
  setUpSearch();
  setUpSeries();
  window.addEventListener("hashchange", route);
  setInterval(() => tick((performance.now() - received) / 1000), 1000);
  setInterval(() => { if (document.body.dataset.view !== "request") refreshSeries(); }, 30000);
  connect();
}

// A module runs after the document is parsed: no need to wait for DOMContentLoaded.
start();
