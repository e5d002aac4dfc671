// onceflow dashboard: reads /dashboard/api/stream (Server-Sent Events over fetch, since
// EventSource cannot send an Authorization header) and renders each snapshot in place.
// The operator key lives in sessionStorage (this tab only) and is only ever sent as
// "Authorization: Bearer <key>". Every value from the server is set with textContent.
"use strict";

const KEY = "onceflow.operatorKey";
const STATUSES = ["queued", "scheduled", "running", "dead"];
const $ = (sel) => document.querySelector(sel);
let controller = null;   // aborts the current stream
let backoff = 1000;      // reconnect delay after an error, doubled up to 30 s
let retryTimer = null;
let received = 0;        // performance.now() when the last snapshot arrived
let snapshots = 0;

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

function cell(row, text, cls, key) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  if (key) td.dataset.k = key;
  row.appendChild(td);
  return td;
}

/** A request's first cells, alike in the running and dead tables: its id (the row's key
 * for its action button), workspace, worker class and stage. */
function requestCells(tr, r) {
  tr.dataset.requestId = r.request_id;
  cell(tr, r.request_id, "id").title = r.request_id;
  cell(tr, r.workspace_id);
  cell(tr, r.worker_class);
  cell(tr, r.stage);
}

function fill(tbody, items, build) {
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    build(tr, item);
    return tr;
  });
  tbody.replaceChildren(...rows);
}

function ageText(seconds) {
  if (seconds < 60) return seconds.toFixed(1) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function actionButton(label, action, item) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = action;
  b.addEventListener("click", () => act(action, item, b));
  return b;
}

function render(s) {
  const depthRows = [];
  const total = Object.fromEntries(STATUSES.map((st) => [st, 0]));
  for (const wc of Object.keys(s.depth).sort()) {
    for (const stage of Object.keys(s.depth[wc]).sort()) {
      depthRows.push([wc, stage, s.depth[wc][stage]]);
      for (const st of STATUSES) total[st] += s.depth[wc][stage][st];
    }
  }
  // A status past the count cap: its counts are lower bounds, shown with "+".
  const more = (st) => ((s.depth_lower_bound || []).includes(st) ? "+" : "");
  fill($("#depth tbody"), depthRows, (tr, [wc, stage, counts]) => {
    cell(tr, wc);
    cell(tr, stage);
    for (const st of STATUSES) cell(tr, counts[st] + more(st), "num", `depth/${wc}/${stage}/${st}`);
  });
  for (const st of STATUSES) document.querySelector(`[data-k="total/${st}"]`).textContent = total[st] + more(st);

  // A database split by workspace: shards that could not be read are left out of every panel.
  const down = s.shards_unavailable || [];
  $("#shards-note").textContent = down.length
    ? `— shard(s) ${down.join(", ")} not answering: their requests are not shown`
    : "";

  const ages = s.oldest_queued_age_seconds;
  fill($("#oldest tbody"), Object.keys(ages).sort(), (tr, wc) => {
    cell(tr, wc);
    const td = cell(tr, ageText(ages[wc]), "num tick", `oldest/${wc}`);
    td.dataset.base = ages[wc];
    td.dataset.kind = "age";
  });

  $('[data-k="ops/last_minute"]').textContent = s.ops.last_minute + (s.ops.capped ? "+" : "");
  $('[data-k="ops/per_second"]').textContent = s.ops.per_second.toFixed(2);

  $("#running-note").textContent = `${s.running.length} shown (newest ${s.running_limit} at most)`;
  fill($("#running tbody"), s.running, (tr, r) => {
    requestCells(tr, r);
    cell(tr, r.holder);
    cell(tr, r.attempt, "num");
    cell(tr, r.lease_expires_at);
    const left = cell(tr, r.lease_seconds_left.toFixed(1) + " s", "num tick");
    left.dataset.base = r.lease_seconds_left;
    left.dataset.kind = "left";
    const td = cell(tr, r.cancel_requested ? "stop requested" : "");
    if (!r.cancel_requested) td.appendChild(actionButton("Cancel", "cancel", r));
  });

  $("#dead-note").textContent = `${s.dead.length} shown (newest ${s.dead_limit} at most)`;
  fill($("#dead tbody"), s.dead, (tr, r) => {
    requestCells(tr, r);
    cell(tr, r.attempts, "num");
    cell(tr, r.finished_at);
    cell(tr, r.error, "error");
    cell(tr, "").appendChild(actionButton("Requeue", "requeue", r));
  });

  const sv = s.savings;
  if (sv.error) {
    $("#savings-note").textContent = "unavailable: " + sv.error;
    fill($("#savings tbody"), [], () => {});
  } else {
    $("#savings-note").textContent = sv.truncated
      ? `first ${sv.workspaces.length} of ${sv.workspaces_total} workspaces`
      : `${sv.workspaces_total} workspace(s)`;
    fill($("#savings tbody"), sv.workspaces, (tr, w) => {
      cell(tr, w.workspace_id);
      cell(tr, w.asked, "num", `savings/${w.workspace_id}/asked`);
      cell(tr, w.made, "num", `savings/${w.workspace_id}/made`);
      cell(tr, w.saved, "num", `savings/${w.workspace_id}/saved`);
    });
  }
  $("#updated").textContent = "database time " + s.db_now;
  document.body.dataset.snapshots = String(++snapshots);
}

// Ages and leases count on from the last snapshot (the server's clock, plus time elapsed here).
function tick() {
  const elapsed = (performance.now() - received) / 1000;
  for (const td of document.querySelectorAll("td.tick")) {
    const value = Number(td.dataset.base) + (td.dataset.kind === "age" ? elapsed : -elapsed);
    td.textContent = td.dataset.kind === "age" ? ageText(value) : value.toFixed(1) + " s";
  }
}

function authHeaders() {
  return { Authorization: "Bearer " + sessionStorage.getItem(KEY) };
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.detail || response.statusText;
  } catch (e) {
    return response.statusText;
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
  if (event === "snapshot") {
    received = performance.now();
    backoff = 1000;
    $("#refusal").hidden = true;
    $("#panels").hidden = false;
    setState("live", "live");
    const first = snapshots === 0;
    render(JSON.parse(data.join("\n")));
    if (first) loadSpend();
  } else if (event === "problem") {
    setState("retrying", JSON.parse(data.join("\n")).detail);
  }
}

async function connect() {
  clearTimeout(retryTimer);
  if (controller) controller.abort();
  if (!sessionStorage.getItem(KEY)) {
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

async function act(action, item, button) {
  const out = $("#action-result");
  out.dataset.outcome = "pending";
  button.disabled = true;
  let text;
  let ok = false;
  try {
    const response = await fetch(
      `/dashboard/api/requests/${encodeURIComponent(item.request_id)}/${action}`,
      {
        method: "POST",
        headers: { ...authHeaders(), "Content-Type": "application/json" },
        // What the operator saw: a running row's run (its identity; a heartbeat moves its
        // version) for cancel, the row's version for requeue. Changed since: 409. And the
        // row's workspace: the request is found by its key, not by its id alone.
        body: JSON.stringify({
          ...(action === "cancel" ? { run: item.run } : { version: item.version }),
          workspace_id: item.workspace_id,
        }),
      },
    );
    if (response.ok) {
      const body = await response.json();
      ok = true;
      text = `${action} ${item.request_id}: done (now ${body.status}).`;
    } else if (response.status === 403) {
      text = `Refused (403): this operator key may not ${action}: it needs the admin role.`;
    } else {
      text = `Refused (${response.status}): ${await errorText(response)}`;
    }
  } catch (err) {
    text = `${action} ${item.request_id} failed: ${err.message}`;
  }
  out.textContent = text;
  out.className = ok ? "ok" : "bad";
  out.dataset.outcome = ok ? "ok" : "refused";
  out.hidden = false;
  button.disabled = false;
}

// Spend from the ledger (not in the snapshot: a month's sums are read every 30 s, not every
// second) and the compute lock's saved calls priced at each workspace's average call cost.
const SPEND_EVERY_MS = 30000;
let spendTimer = null;

async function loadSpend() {
  clearTimeout(spendTimer);
  spendTimer = setTimeout(loadSpend, SPEND_EVERY_MS);
  if (!sessionStorage.getItem(KEY) || $("#panels").hidden) return;
  const now = new Date();
  const since = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1)).toISOString();
  const query = new URLSearchParams([["since", since], ["by", "workspace"], ["by", "provider"]]);
  loadBudgets();
  try {
    const [spend, saved] = await Promise.all([
      fetch("/dashboard/api/spend?" + query, { headers: authHeaders(), cache: "no-store" }),
      fetch("/dashboard/api/spend/savings", { headers: authHeaders(), cache: "no-store" }),
    ]);
    if (!spend.ok) {
      $("#spend-note").textContent = "unavailable: " + (await errorText(spend));
      return;
    }
    const report = await spend.json();
    const total = report.total;
    let note = `total ${total.cost} over ${total.calls} call(s)`;
    if (saved.ok) {
      const sv = await saved.json();
      if (!sv.error) note += `; saved by the compute lock ≈ ${sv.saved_cost_total}`;
    }
    $("#spend-note").textContent = note;
    fill($("#spend tbody"), report.rows, (tr, r) => {
      cell(tr, r.workspace);
      cell(tr, r.provider);
      cell(tr, r.calls, "num");
      cell(tr, r.input_tokens, "num");
      cell(tr, r.output_tokens, "num");
      cell(tr, r.cost, "num");
    });
  } catch (err) {
    $("#spend-note").textContent = "unavailable: " + err.message;
  }
}

// Budgets with their current period's standing, read with the spend. "Used" is the period's
// settled spend over the limit; a budget with both limits shows the larger share (the limit
// it reaches first). Calls in flight hold their estimates until they settle: shown beside
// it, and as the bar's lighter part. At or past 100 % the budget admits no more calls.
const NEAR_PERCENT = 80;

/** `part` as a percentage of `limit` (decimal strings or numbers); null without that limit. */
function share(part, limit) {
  if (limit === null || limit === undefined) return null;
  const p = Number(part);
  const l = Number(limit);
  if (l > 0) return (p / l) * 100;
  return p > 0 ? Infinity : 100;  // a zero limit admits nothing: it is used up
}

/** A percentage as shown: rounded down to 0.1 (80 % is not shown before it is reached). */
function percentText(value) {
  if (!Number.isFinite(value)) return "∞ %";
  return (Math.floor(value * 10 + 1e-6) / 10).toFixed(1) + " %";
}

function untilText(seconds) {
  return seconds >= 86400 ? (seconds / 86400).toFixed(1) + " d" : ageText(Math.max(seconds, 0));
}

/** What a budget's row shows: the limits it has (money, tokens), its share used, and the
 * share its calls in flight hold, on the same limit. */
function standing(b) {
  const parts = [];
  if (b.limit_cost !== null) {
    parts.push({
      basis: "cost", limit: b.limit_cost, spent: b.spent_cost, reserved: b.reserved_cost,
      used: share(b.spent_cost, b.limit_cost), held: share(b.reserved_cost, b.limit_cost),
    });
  }
  if (b.limit_tokens !== null) {
    parts.push({
      basis: "tokens", limit: `${b.limit_tokens} tokens`, spent: `${b.spent_tokens} tokens`,
      reserved: `${b.reserved_tokens} tokens`,
      used: share(b.spent_tokens, b.limit_tokens), held: share(b.reserved_tokens, b.limit_tokens),
    });
  }
  const top = parts.reduce((a, p) => (a === null || p.used > a.used ? p : a), null);
  const mark = top.used >= 100 ? "exceeded" : top.used >= NEAR_PERCENT ? "near" : "";
  return { parts, top, mark, both: parts.length > 1 };
}

function bar(used, held) {
  const outer = document.createElement("span");
  outer.className = "bar";
  outer.setAttribute("aria-hidden", "true");  // the number is in the cell's text
  const spent = document.createElement("span");
  spent.className = "spent";
  const width = Number.isFinite(used) ? Math.min(Math.max(used, 0), 100) : 100;
  spent.style.width = width + "%";
  const inFlight = document.createElement("span");
  inFlight.className = "held";
  const heldWidth = Number.isFinite(held) ? Math.min(Math.max(held, 0), 100 - width) : 0;
  inFlight.style.width = heldWidth + "%";
  outer.append(spent, inFlight);
  return outer;
}

async function loadBudgets() {
  const note = $("#budgets-note");
  const tbody = $("#budgets tbody");
  try {
    const response = await fetch("/dashboard/api/spend/budgets", {
      headers: authHeaders(), cache: "no-store",
    });
    if (!response.ok) {
      note.textContent = "unavailable: " + (await errorText(response));
      fill(tbody, [], () => {});
      return;
    }
    const rows = (await response.json()).budgets.map((b) => ({ b, s: standing(b) }));
    rows.sort((x, y) => y.s.top.used - x.s.top.used
      || x.b.workspace_id.localeCompare(y.b.workspace_id) || x.b.period.localeCompare(y.b.period));
    const count = (mark) => rows.filter((r) => r.s.mark === mark).length;
    note.textContent = rows.length
      ? `${rows.length} budget(s); ${count("exceeded")} exceeded, ${count("near")} over ${NEAR_PERCENT} %`
      : "none set";
    fill(tbody, rows, (tr, { b, s }) => {
      const k = `budget/${b.workspace_id}/${b.period}`;
      tr.dataset.budget = `${b.workspace_id}/${b.period}`;
      tr.dataset.mark = s.mark;
      if (s.mark) tr.className = s.mark;
      const joined = (field) => s.parts.map((p) => p[field]).join(" · ");
      cell(tr, b.workspace_id);
      cell(tr, b.period);
      cell(tr, joined("limit"), "num", `${k}/limit`);
      cell(tr, joined("spent"), "num", `${k}/spent`);
      const calls = b.in_flight === 1 ? "1 call" : `${b.in_flight} calls`;
      cell(tr, b.in_flight ? `${joined("reserved")} (${calls})` : "none", "num", `${k}/reserved`);
      let used = percentText(s.top.used) + (s.both ? ` of ${s.top.basis}` : "");
      if (b.in_flight && s.top.held > 0) used += ` + ${percentText(s.top.held)} in flight`;
      const td = cell(tr, used, "used", `${k}/used`);
      td.title = s.parts.map((p) => `${p.basis}: ${percentText(p.used)} spent, `
        + `${percentText(p.held)} in flight`).join("; ");
      td.appendChild(bar(s.top.used, s.top.held));
      cell(tr, { exceeded: "exceeded", near: `over ${NEAR_PERCENT} %` }[s.mark] || "ok", "mark");
      cell(tr, b.on_exceeded);
      cell(tr, `${b.period_ends} (in ${untilText(b.period_ends_in)})`);
    });
  } catch (err) {
    note.textContent = "unavailable: " + err.message;
    fill(tbody, [], () => {});
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("#key").value.trim();
    $("#key").value = "";
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("#refusal").hidden = true;
    backoff = 1000;
    connect();
  });
  $("#forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    if (controller) controller.abort();
    $("#panels").hidden = true;
    setState("no-key", "enter an operator key");
  });
  setInterval(tick, 1000);
  connect();
});
