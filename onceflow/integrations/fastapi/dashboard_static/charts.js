// Line charts as inline SVG, drawn here (no library, nothing loaded from elsewhere).
//
// A chart is a <figure data-chart="name">: an <svg role="img"> whose <title> and aria-label
// say each series' last point, one <path data-series data-values> per series (broken where
// a bucket has no value), and an HTML legend whose entries carry data-series, data-last (the
// last point) and data-total, so a reader (or a test) gets the numbers without reading
// pixels. Colours come from classes (.s0 … .s7 in dashboard.css): the page's CSP allows no
// inline style.

import { el } from "./util.js";

const SVG = "http://www.w3.org/2000/svg";
const W = 400;
const H = 120;
const PAD = 4;
const COLOURS = 8;

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

/** A number as a chart shows it: whole numbers plain, others to 3 significant digits. */
export function pointText(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Number.isInteger(value)) return String(value);
  return String(Number(value.toPrecision(3)));
}

/**
 * Draw ``spec`` into ``figure`` (replacing what it held).
 *
 * spec: {title, unit, times: [iso, …], series: [{key, label, values: [number|null, …]}],
 *        limit: {label, value} (a horizontal line, e.g. a budget), empty: "text when no data"}
 */
export function drawChart(figure, spec) {
  const times = spec.times || [];
  const series = spec.series || [];
  const values = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
  const limit = spec.limit && Number.isFinite(Number(spec.limit.value)) ? Number(spec.limit.value) : null;
  const top = Math.max(1e-9, ...values, limit === null ? 0 : limit);
  const n = times.length;
  const x = (i) => PAD + (n <= 1 ? (W - 2 * PAD) / 2 : (i * (W - 2 * PAD)) / (n - 1));
  const y = (v) => H - PAD - (v / top) * (H - 2 * PAD);

  const lastText = series.map((s) => `${s.label} ${pointText(last(s.values))}`).join(", ");
  const summary = `${spec.title}: last point ${lastText || "none"}` + (spec.unit ? ` (${spec.unit})` : "");
  const svg = svgEl("svg", {
    viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": summary, preserveAspectRatio: "none",
  });
  const title = svgEl("title");
  title.textContent = summary;
  svg.appendChild(title);
  svg.appendChild(svgEl("line", { x1: 0, y1: H - PAD, x2: W, y2: H - PAD, class: "axis" }));
  if (limit !== null) {
    const line = svgEl("line", { x1: 0, y1: y(limit), x2: W, y2: y(limit), class: "limit" });
    line.dataset.limit = String(limit);
    svg.appendChild(line);
  }
  series.forEach((s, i) => {
    // One path per series; a bucket with no value breaks the line (a new "M" after it)
    // rather than joining its neighbours across the gap.
    const points = [];
    const steps = [];
    let gap = true;
    s.values.forEach((v, j) => {
      if (v === null || v === undefined) {
        gap = true;
        return;
      }
      const point = `${x(j).toFixed(1)},${y(v).toFixed(1)}`;
      points.push(point);
      steps.push((gap ? "M" : "L") + point);
      gap = false;
    });
    const line = svgEl("path", {
      d: steps.join(" "), class: `line s${i % COLOURS}`, fill: "none",
      "vector-effect": "non-scaling-stroke",
    });
    line.dataset.series = s.key;
    line.dataset.values = s.values.map((v) => (v === null || v === undefined ? "" : v)).join(",");
    svg.appendChild(line);
    if (points.length) {  // the last point, marked
      const [cx, cy] = points[points.length - 1].split(",");
      svg.appendChild(svgEl("circle", { cx, cy, r: 2.5, class: `dot s${i % COLOURS}` }));
    }
  });

  const legend = el("ul", "legend");
  series.forEach((s, i) => {
    const li = el("li");
    li.dataset.series = s.key;
    li.dataset.last = String(last(s.values) ?? "");
    li.dataset.total = String(s.values.reduce((a, v) => a + (v || 0), 0));
    li.append(el("span", `swatch s${i % COLOURS}`), el("span", "name", s.label),
      el("span", "value", pointText(last(s.values))));
    legend.appendChild(li);
  });
  if (limit !== null) {
    const li = el("li", "limit-key");
    li.dataset.series = "limit";
    li.dataset.last = String(limit);
    li.append(el("span", "swatch limit"), el("span", "name", spec.limit.label),
      el("span", "value", pointText(limit)));
    legend.appendChild(li);
  }

  const axis = el("div", "axis-text");
  axis.append(el("span", "from", n ? shortTime(times[0]) : ""),
    el("span", "peak", `peak ${pointText(values.length ? Math.max(...values) : 0)}`),
    el("span", "to", n ? shortTime(times[n - 1]) + " UTC" : ""));

  const caption = el("figcaption", "", spec.title);
  if (spec.unit) caption.appendChild(el("small", "", " " + spec.unit));
  figure.dataset.points = String(n);
  const parts = [caption, svg, legend, axis];
  if (!values.length) parts.push(el("p", "empty", spec.empty || "nothing in this range yet"));
  figure.replaceChildren(...parts);
}

/** A bucket's time on the axis: month-day and hour:minute, UTC. */
function shortTime(iso) {
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return d.toISOString().slice(5, 16).replace("T", " ");
}

function last(values) {
  for (let i = values.length - 1; i >= 0; i--) {
    if (values[i] !== null && values[i] !== undefined) return values[i];
  }
  return null;
}
