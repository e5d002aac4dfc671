// One request's page (#/requests/<id>?ws=<workspace>): GET /dashboard/api/requests/{id}.
// Its input, result or error as text (a <pre> filled with textContent), the status history
// on the database clock, the attempts, the hand-offs (links to those requests' pages), the
// ops it wrote with their clocks, the compute locks it took and whether it paid, its spend,
// and requeue / cancel where the server says this key may.

import { actionButton } from "./actions.js";
import { $, ApiError, cell, el, fill, getJson, requestLink, timeText } from "./util.js";

let shown = null;  // {id, ws} of the page shown
let drawn = "";    // what was drawn (the answer without its clock): unchanged, not redrawn
let inFlight = null;

function facts(dl, pairs) {
  const nodes = [];
  for (const [label, value, key] of pairs) {
    const dd = el("dd");
    if (value instanceof Node) dd.appendChild(value);
    else dd.textContent = value === null || value === undefined ? "–" : String(value);
    if (key) dd.dataset.k = key;
    nodes.push(el("dt", "", label), dd);
  }
  dl.replaceChildren(...nodes);
}

function payload(pre, note, part, withheld, none) {
  if (withheld) {
    pre.textContent = "";
    note.textContent = "withheld: this key may not read this workspace's data";
  } else if (!part) {
    pre.textContent = "";
    note.textContent = none;
  } else {
    pre.textContent = part.text;
    note.textContent = part.truncated ? "cut at 64 KiB" : "";
  }
}

function detailText(detail) {
  if (!detail || typeof detail !== "object") return "";
  return Object.entries(detail)
    .map(([k, v]) => `${k}: ${Array.isArray(v) ? v.join(", ") : typeof v === "object" && v !== null ? JSON.stringify(v) : v}`)
    .join("; ");
}

/** Show the page of request ``id`` (in workspace ``ws`` when known). */
export async function showRequest(id, ws) {
  const again = document.body.dataset.request === "shown" && shown !== null && shown.id === id;
  shown = { id, ws };
  $("#req-id").textContent = id;
  const note = $("#req-note");
  if (inFlight) inFlight.abort();
  const mine = (inFlight = new AbortController());
  if (!again) note.textContent = "loading";
  document.body.dataset.request = again ? "loading-again" : "loading";
  try {
    const query = ws ? "?workspace_id=" + encodeURIComponent(ws) : "";
    const data = await getJson(`/dashboard/api/requests/${encodeURIComponent(id)}${query}`, mine.signal);
    if (mine !== inFlight) return;
    // Drawn again only when something changed: a selection or a scrolled <pre> stays put.
    const same = JSON.stringify({ ...data, db_now: null });
    if (same !== drawn || document.body.dataset.request !== "loading-again") render(data);
    drawn = same;
    note.textContent = "as of database time " + data.db_now;
    document.body.dataset.request = "shown";
  } catch (err) {
    if (err.name === "AbortError" || mine !== inFlight) return;
    const missing = err instanceof ApiError && err.status === 404;
    if (again && !missing) {
      // A live re-read failed: what is drawn stays, the note says why, and the next
      // snapshot reads the page again.
      note.textContent = `unavailable, showing the last read: ${err.message}`;
      document.body.dataset.request = "shown";
      return;
    }
    note.textContent = missing ? `not found: ${err.message}` : `unavailable: ${err.message}`;
    document.body.dataset.request = "failed";
    drawn = "";
    clear();
  }
}

/** Read the page again (a live update), unless the operator left it. */
export function refreshRequest() {
  if (shown && document.body.dataset.view === "request" && document.body.dataset.request === "shown") {
    showRequest(shown.id, shown.ws);
  }
}

function clear() {
  for (const sel of ["#req-facts", "#req-handoffs", "#req-actions"]) $(sel).replaceChildren();
  for (const sel of ["#req-history", "#req-attempts", "#req-locks", "#req-ops", "#req-spend"]) {
    fill($(sel + " tbody"), [], () => {});
  }
  $("#req-input").textContent = "";
  $("#req-outcome").textContent = "";
}

function render(d) {
  const r = d.request;
  const page = $("#view-request");
  page.dataset.requestId = r.request_id;
  page.dataset.workspaceId = r.workspace_id;
  page.dataset.status = r.status;
  facts($("#req-facts"), [
    ["status", r.status + (r.cancel_requested && r.status === "running" ? " (stop requested)" : ""), "req/status"],
    ["workspace", r.workspace_id, "req/workspace_id"],
    ["job", searchLink({ job: r.job_id }, r.job_id), "req/job_id"],
    ["branch", r.branch_path || "(root)", "req/branch_path"],
    ["stage", r.stage, "req/stage"],
    ["worker class", r.worker_class, "req/worker_class"],
    ["priority", r.priority, "req/priority"],
    ["attempts", `${r.attempts} of ${r.max_attempts}`, "req/attempts"],
    ["crash attempts", `${r.crash_attempts} of ${r.max_crash_attempts}`, "req/crash_attempts"],
    ["created", timeText(r.created_at), "req/created_at"],
    ["due", timeText(r.run_after), "req/run_after"],
    ["updated", timeText(r.updated_at), "req/updated_at"],
    ["finished", timeText(r.finished_at) || "–", "req/finished_at"],
    ["held by", r.claimed_by, "req/claimed_by"],
    ["lease expires", timeText(r.lease_expires_at) || "–", "req/lease_expires_at"],
    ["last heartbeat", timeText(r.heartbeat_at) || "–", "req/heartbeat_at"],
  ]);

  payload($("#req-input"), $("#req-input-note"), d.input, d.withheld, "none stored");
  const failed = !d.result && d.error;
  $("#req-outcome-title").firstChild.textContent = failed ? "Error " : "Result ";
  payload($("#req-outcome"), $("#req-outcome-note"), failed ? d.error : d.result, d.withheld,
    r.status === "succeeded" ? "none stored" : `none yet (${r.status})`);

  fill($("#req-history tbody"), d.history, (tr, h) => {
    tr.dataset.event = h.event;
    cell(tr, timeText(h.at));
    cell(tr, h.event, "status " + h.event);
    cell(tr, h.attempt === null || h.attempt === undefined ? "" : h.attempt, "num");
    const td = cell(tr, "", "wrap");
    if (h.event === "handed_off" && h.detail && Array.isArray(h.detail.to)) {
      td.append("to ");
      h.detail.to.forEach((to, i) => {
        if (i) td.append(", ");
        td.appendChild(requestLink(to, r.workspace_id));
      });
    } else {
      td.textContent = detailText(h.detail);
    }
  });

  fill($("#req-attempts tbody"), d.attempts, (tr, a) => {
    tr.dataset.attempt = a.attempt;
    cell(tr, a.attempt, "num", `attempt/${a.attempt}/attempt`);
    cell(tr, a.claimed_by, "", `attempt/${a.attempt}/claimed_by`);
    cell(tr, timeText(a.claimed_at));
    cell(tr, a.lease_seconds === null || a.lease_seconds === undefined ? "" : a.lease_seconds + " s", "num");
    cell(tr, timeText(a.last_heartbeat_at));
    cell(tr, timeText(a.ended_at));
    cell(tr, a.outcome, "status " + a.outcome, `attempt/${a.attempt}/outcome`);
    cell(tr, a.next_status || "");
    cell(tr, a.error_type ? `${a.error_type}: ${a.error_message || ""}` : "", "error");
    cell(tr, (a.locks || []).map((l) => `${l.cell} (${l.outcome})`).join(", "), "wrap");
  });

  const handoffs = d.hand_offs || { from: [], to: [] };
  const links = (ids) => {
    if (!ids.length) return "none";
    const span = el("span");
    ids.forEach((id, i) => {
      if (i) span.append(", ");
      span.appendChild(requestLink(id, r.workspace_id));
    });
    return span;
  };
  facts($("#req-handoffs"), [
    ["handed from", links(handoffs.from), "req/handoffs_from"],
    ["handed to", links(handoffs.to), "req/handoffs_to"],
  ]);

  const locks = d.locks || [];
  const paid = locks.filter((l) => l.outcome === "paid").length;
  $("#req-locks-note").textContent = locks.length
    ? `${locks.length} lock(s): ${paid} paid, ${locks.length - paid} not paid`
    : "none taken";
  fill($("#req-locks tbody"), locks, (tr, l) => {
    cell(tr, l.cell, "wrap");
    cell(tr, l.outcome);
    const isPaid = l.outcome === "paid";
    cell(tr, isPaid ? "paid" : "not paid", isPaid ? "paid" : "free");
    cell(tr, l.attempt === null || l.attempt === undefined ? "" : l.attempt, "num");
  });

  $("#req-ops-note").textContent = `${d.ops.length} op(s)` + (d.ops_truncated ? " (first 500)" : "");
  fill($("#req-ops tbody"), d.ops, (tr, o) => {
    tr.dataset.opId = o.op_id;
    cell(tr, o.clock, "num");
    cell(tr, o.sub_doc, "wrap");
    cell(tr, o.op_id, "id");
    cell(tr, o.op_type);
    cell(tr, timeText(o.committed_at));
    cell(tr, o.rejected ? "rejected" : "");
  });

  const spend = d.spend || [];
  const costSum = spend.reduce((a, s) => a + Number(s.cost || 0), 0);
  $("#req-spend-note").textContent = spend.length
    ? `${spend.length} line(s), cost ${Number(costSum.toPrecision(12))}`
    : "no provider calls recorded";
  fill($("#req-spend tbody"), spend, (tr, s) => {
    cell(tr, timeText(s.recorded_at));
    cell(tr, s.provider);
    cell(tr, s.model);
    cell(tr, s.cell_key || "", "wrap");
    cell(tr, s.outcome);
    cell(tr, s.input_tokens, "num");
    cell(tr, s.output_tokens, "num");
    cell(tr, s.cost, "num");
    cell(tr, s.saved_cost === null || s.saved_cost === undefined ? "" : s.saved_cost, "num");
  });

  const actions = $("#req-actions");
  const a = d.actions || {};
  const buttons = [];
  // Read again after the action only if the operator is still on this request's page.
  const after = (ok) => {
    if (ok && document.body.dataset.view === "request" && shown && shown.id === r.request_id) {
      showRequest(shown.id, shown.ws);
    }
  };
  if (a.requeue) {
    buttons.push(actionButton("Requeue", "requeue", {
      request_id: r.request_id, workspace_id: r.workspace_id, version: a.requeue_version,
    }, after));
  }
  if (a.cancel) {
    buttons.push(actionButton(a.cancel_run ? "Ask to stop" : "Cancel", "cancel", {
      request_id: r.request_id, workspace_id: r.workspace_id,
      run: a.cancel_run, version: a.cancel_version,
    }, after));
  }
  actions.replaceChildren(...buttons);
}

/** A link to the request list filtered by ``filters``, showing ``text``. */
function searchLink(filters, text) {
  const a = el("a", "", text);
  a.href = "#/requests?" + new URLSearchParams(filters);
  return a;
}
