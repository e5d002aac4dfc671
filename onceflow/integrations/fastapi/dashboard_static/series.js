// The history charts: GET /dashboard/api/series?range=hour|day|week[&worker_class=…],
// read when the range or class changes, and again with the live snapshots (at most every
// REFRESH_MS). Every bucket of the range is listed by the server, oldest first.

import { drawChart } from "./charts.js";
import { $, $$, ApiError, getJson, hasKey } from "./util.js";

const REFRESH_MS = 10000;  // the rollup is written once a minute: no need for more
const MAX_CLASSES = 8;
let knownClasses = [];
let lastRead = 0;
let inFlight = null;

function settings() {
  const form = $("#series-form");
  return { range: form.elements.range.value || "hour", worker_class: form.elements.worker_class.value };
}

/** Offer the worker classes the snapshot knows in the class filter (keeping the choice). */
export function offerClasses(classes) {
  knownClasses = classes;
  const select = $("#series-class");
  const have = [...select.options].slice(1).map((o) => o.value);
  if (have.join("\n") === classes.join("\n")) return;
  const chosen = select.value;
  const options = [new Option("all", "")];
  for (const wc of classes) options.push(new Option(wc, wc));
  if (chosen && !classes.includes(chosen)) options.push(new Option(chosen, chosen));
  select.replaceChildren(...options);
  select.value = chosen;
}

/** Read the series again if the last read is older than REFRESH_MS (or ``force``). */
export function refreshSeries(force = false) {
  if (!hasKey() || $("#panels").hidden) return;  // no key, or refused: nothing to read
  if (!force && performance.now() - lastRead < REFRESH_MS) return;
  lastRead = performance.now();
  load();
}

export function setUpSeries() {
  $("#series-form").addEventListener("change", () => refreshSeries(true));
  $("#series-form").addEventListener("submit", (e) => e.preventDefault());
}

const per = (buckets, f) => buckets.map((b) => (b[f] === null || b[f] === undefined ? null : Number(b[f])));

/** Sparse points ({t, …}) onto the buckets' times: 0 where a bucket has none. */
function onto(times, points, f) {
  const at = new Map(points.map((p) => [Date.parse(p.t), p]));
  return times.map((t) => {
    const p = at.get(Date.parse(t));
    return p && p[f] !== null && p[f] !== undefined ? Number(p[f]) : 0;
  });
}

function cumulative(values) {
  let sum = 0;
  return values.map((v) => (sum += v || 0));
}

async function load() {
  if (inFlight) inFlight.abort();
  const mine = (inFlight = new AbortController());
  const { range, worker_class } = settings();
  const query = new URLSearchParams({ range });
  if (worker_class) query.set("worker_class", worker_class);
  const note = $("#series-note");
  try {
    // Failures per worker class: one read per class (at most MAX_CLASSES) beside the total.
    const classes = worker_class ? [] : knownClasses.slice(0, MAX_CLASSES);
    const [s, ...perClass] = await Promise.all([
      getJson("/dashboard/api/series?" + query, mine.signal),
      ...classes.map((wc) => getJson("/dashboard/api/series?" + new URLSearchParams({ range, worker_class: wc }), mine.signal)),
    ]);
    if (mine !== inFlight) return;
    draw(s);
    drawFailuresByClass(s, worker_class ? [[worker_class, s]] : classes.map((wc, i) => [wc, perClass[i]]));
    const step = s.step_seconds >= 3600 ? s.step_seconds / 3600 + " h" : s.step_seconds >= 60 ? s.step_seconds / 60 + " min" : s.step_seconds + " s";
    const down = s.shards_unavailable || [];
    note.textContent = `per ${step}, ${s.buckets.length} buckets, database clock`
      + (worker_class ? `; worker class ${worker_class}` : "")
      + (down.length ? `; shard(s) ${down.join(", ")} not answering` : "");
    $("#charts").dataset.range = s.range;
  } catch (err) {
    if (err.name === "AbortError") return;
    note.textContent = err instanceof ApiError && err.status === 404
      ? "history is not available on this server"
      : "unavailable: " + err.message;
  }
}

/** Dead and rescued (a crashed run's lease) per bucket, one line per worker class. */
function drawFailuresByClass(s, pairs) {
  const times = s.buckets.map((x) => x.t);
  drawChart(chart("failures-by-class"), {
    title: "Failures and crashes per worker class", unit: "dead + rescued per bucket", times,
    series: pairs.map(([wc, one]) => ({
      key: wc, label: wc, values: one.buckets.map((x) => Number(x.dead || 0) + Number(x.rescued || 0)),
    })),
    empty: "no worker class known yet",
  });
}

function chart(name) {
  return $(`figure[data-chart="${name}"]`);
}

function draw(s) {
  const b = s.buckets;
  const times = b.map((x) => x.t);
  const scope = s.worker_class ? ` (${s.worker_class})` : "";
  drawChart(chart("throughput"), {
    title: "Throughput" + scope, unit: "requests per bucket", times,
    series: [
      { key: "enqueued", label: "enqueued", values: per(b, "enqueued") },
      { key: "claimed", label: "claimed", values: per(b, "claimed") },
      { key: "succeeded", label: "succeeded", values: per(b, "succeeded") },
    ],
  });
  drawChart(chart("depth"), {
    title: "Queue depth" + scope, unit: "highest sampled by a sweep", times,
    series: [
      { key: "queued_max", label: "queued", values: per(b, "queued_max") },
      { key: "running_max", label: "running", values: per(b, "running_max") },
    ],
    empty: "no sweep sampled the queue in this range",
  });
  drawChart(chart("pickup"), {
    title: "Pickup latency" + scope, unit: "seconds from due to claimed", times,
    series: [
      { key: "mean", label: "mean", values: b.map((x) => (x.pickup ? x.pickup.mean_seconds : null)) },
      { key: "max", label: "max", values: b.map((x) => (x.pickup && x.pickup.count ? x.pickup.max_seconds : null)) },
    ],
    empty: "no claims in this range",
  });
  drawChart(chart("failures"), {
    title: "Failures and crashes" + scope, unit: "requests per bucket", times,
    series: [
      { key: "dead", label: "dead", values: per(b, "dead") },
      { key: "rescued", label: "crashed (lease rescued)", values: per(b, "rescued") },
      { key: "cancelled", label: "cancelled", values: per(b, "cancelled") },
    ],
  });
  // Cumulative from the range's start: the gap between asked and paid is what the lock saved.
  const sv = s.savings || [];
  const svTimes = sv.length ? sv.map((x) => x.t) : times;
  const running = (f) => (sv.length ? cumulative(per(sv, f)) : []);
  drawChart(chart("savings"), {
    title: "Compute-lock calls", unit: "cumulative over the range, every workspace", times: svTimes,
    series: [
      { key: "asked", label: "asked", values: running("asked") },
      { key: "made", label: "paid", values: running("made") },
      { key: "saved", label: "saved", values: running("saved") },
    ],
    empty: "nothing counted in this range",
  });
  // Tokens and money: cumulative over the range per provider, against the day budgets of
  // the workspaces listed (their sum: a day budget limits a UTC calendar day's spend, so
  // the line is drawn for the hour and day ranges only).
  const providers = (s.spend && s.spend.by_provider) || [];
  const dayLimit = (field, unit) => {
    const day = (s.budgets || []).filter((x) => x.period === "day" && x[field] !== null && x[field] !== undefined);
    if (!day.length || s.range === "week") return null;
    return { label: `day budgets${unit} (${day.length}, summed)`, value: day.reduce((a, x) => a + Number(x[field]), 0) };
  };
  drawChart(chart("tokens"), {
    title: "Tokens per provider", unit: "input + output, cumulative over the range", times,
    series: providers.map((p) => {
      const input = onto(times, p.points, "input_tokens");
      const output = onto(times, p.points, "output_tokens");
      return { key: p.provider, label: p.provider, values: cumulative(input.map((v, i) => v + output[i])) };
    }),
    limit: dayLimit("limit_tokens", " in tokens"),
    empty: "no provider calls in this range",
  });
  drawChart(chart("cost"), {
    title: "Cost per provider", unit: "cumulative over the range", times,
    series: providers.map((p) => ({ key: p.provider, label: p.provider, values: cumulative(onto(times, p.points, "cost")) })),
    limit: dayLimit("limit_cost", ""),
    empty: "no provider calls in this range",
  });
  for (const fig of $$("figure.chart")) fig.dataset.range = s.range;
}
