// The overview's panels from one snapshot (the stream's) and from the spend routes.

import { actionButton } from "./actions.js";
import {
  $, ageText, authHeaders, cell, el, errorText, fill, fillKeyed, hasKey, num, requestLink,
} from "./util.js";

const STATUSES = ["queued", "scheduled", "running", "dead"];

/** A request's first cells, alike in the running and dead tables: its id (a link to its
 * page, and the row's key for its action button), workspace, worker class and stage. */
function requestCells(tr, r) {
  tr.dataset.requestId = r.request_id;
  const td = cell(tr, "", "id");
  td.appendChild(requestLink(r.request_id, r.workspace_id));
  cell(tr, r.workspace_id);
  cell(tr, r.worker_class);
  cell(tr, r.stage);
}

// The running and dead tables carry action buttons. A row that did not change is kept (not
// rebuilt), and while a button is pressed neither table changes: a snapshot arriving between
// the press and the release would otherwise replace the button and lose the click. The
// tables catch up with the latest snapshot when the button is released.
let latest = null;
let pressed = false;

function renderActionTables() {
  const s = latest;
  if (!s || pressed) return;
  $("#running-note").textContent = `${s.running.length} shown (newest ${s.running_limit} at most)`;
  // A run is the same row while it runs: its lease moves (heartbeats), its fence does not.
  const runKey = (r) => JSON.stringify([r.workspace_id, r.request_id, r.run, r.attempt, r.holder,
    r.cancel_requested]);
  const lease = (tr, r) => {
    tr.querySelector("td.expires").textContent = r.lease_expires_at;
    const left = tr.querySelector("td.tick");
    left.textContent = r.lease_seconds_left.toFixed(1) + " s";
    left.dataset.base = r.lease_seconds_left;
  };
  fillKeyed($("#running tbody"), s.running, runKey, (tr, r) => {
    requestCells(tr, r);
    cell(tr, r.holder);
    cell(tr, r.attempt, "num");
    cell(tr, "", "expires");
    cell(tr, "", "num tick").dataset.kind = "left";
    lease(tr, r);
    const td = cell(tr, r.cancel_requested ? "stop requested" : "");
    if (!r.cancel_requested) td.appendChild(actionButton("Cancel", "cancel", r));
  }, lease);

  $("#dead-note").textContent = `${s.dead.length} shown (newest ${s.dead_limit} at most)`;
  fillKeyed($("#dead tbody"), s.dead, (r) => JSON.stringify(r), (tr, r) => {
    requestCells(tr, r);
    cell(tr, r.attempts, "num");
    cell(tr, r.finished_at);
    cell(tr, r.error, "error");
    cell(tr, "").appendChild(actionButton("Requeue", "requeue", r));
  });
}

document.addEventListener("pointerdown", (event) => {
  if (event.target.closest && event.target.closest("#running button, #dead button")) pressed = true;
});
for (const type of ["pointerup", "pointercancel"]) {
  window.addEventListener(type, () => {
    if (!pressed) return;
    // After the click this release makes has run.
    setTimeout(() => {
      pressed = false;
      renderActionTables();
    }, 0);
  });
}

/** The worker classes the snapshot knows (for the charts' class filter). */
export function workerClasses(s) {
  return Object.keys(s.depth || {}).sort();
}

export function renderSnapshot(s) {
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
  for (const st of STATUSES) $(`[data-k="total/${st}"]`).textContent = total[st] + more(st);
  $('[data-k="now/queued"]').textContent = total.queued + more("queued");
  $('[data-k="now/running"]').textContent = total.running + more("running");
  $('[data-k="now/dead"]').textContent = total.dead + more("dead");

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

  latest = s;
  renderActionTables();

  renderSavings(s.savings);
  $("#updated").textContent = "database time " + s.db_now;
}

/** The headline: calls asked, paid and saved over every workspace counted, and per workspace. */
function renderSavings(sv) {
  const tbody = $("#savings tbody");
  const figures = ["asked", "made", "saved"];
  const empty = $("#savings-empty");
  if (sv.error) {
    $("#savings-note").textContent = "unavailable: " + sv.error;
    for (const f of figures) $(`[data-k="savings/total/${f}"]`).textContent = "–";
    empty.hidden = true;
    fill(tbody, [], () => {});
    return;
  }
  const sum = (f) => sv.workspaces.reduce((a, w) => a + w[f], 0);
  const totals = Object.fromEntries(figures.map((f) => [f, sum(f)]));
  for (const f of figures) {
    const node = $(`[data-k="savings/total/${f}"]`);
    node.textContent = num(totals[f]);
    node.dataset.value = String(totals[f]);
  }
  const counted = sv.workspaces.length;
  if (!counted || !totals.asked) {
    $("#savings-note").textContent = "nothing counted yet";
    empty.hidden = false;
  } else {
    empty.hidden = true;
    const share = Math.round((totals.saved / totals.asked) * 1000) / 10;
    // A key limited to some workspaces gets no total when not every workspace was read.
    const over = !sv.truncated
      ? `over ${counted === 1 ? "1 workspace" : counted + " workspaces"}`
      : sv.workspaces_total === null || sv.workspaces_total === undefined
        ? `over ${counted} of the first ${sv.limit} workspaces read`
        : `over the first ${counted} of ${sv.workspaces_total} workspaces`;
    $("#savings-note").textContent = `${share} % of calls saved, ${over}, since the counters began`;
  }
  $("#savings").parentElement.hidden = counted === 0;
  fill(tbody, sv.workspaces, (tr, w) => {
    cell(tr, w.workspace_id);
    cell(tr, w.asked, "num", `savings/${w.workspace_id}/asked`);
    cell(tr, w.made, "num", `savings/${w.workspace_id}/made`);
    cell(tr, w.saved, "num", `savings/${w.workspace_id}/saved`);
  });
}

// Ages and leases count on from the last snapshot (the server's clock, plus time elapsed here).
export function tick(elapsed) {
  for (const td of document.querySelectorAll("td.tick")) {
    const value = Number(td.dataset.base) + (td.dataset.kind === "age" ? elapsed : -elapsed);
    td.textContent = td.dataset.kind === "age" ? ageText(value) : value.toFixed(1) + " s";
  }
}

// Spend from the ledger (not in the snapshot: a month's sums are read every 30 s, not every
// second) and the compute lock's saved calls priced at each workspace's average call cost.
const SPEND_EVERY_MS = 30000;
let spendTimer = null;

export async function loadSpend() {
  clearTimeout(spendTimer);
  spendTimer = setTimeout(loadSpend, SPEND_EVERY_MS);
  if (!hasKey() || $("#panels").hidden) return;
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
  const outer = el("span", "bar");
  outer.setAttribute("aria-hidden", "true");  // the number is in the cell's text
  const spent = el("span", "spent");
  const width = Number.isFinite(used) ? Math.min(Math.max(used, 0), 100) : 100;
  spent.style.width = width + "%";
  const inFlight = el("span", "held");
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
