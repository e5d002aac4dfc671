"""Layout checks run in the page: no two visible text elements overlap, nothing spills sideways.

:data:`TEXT_BOXES` collects the box of every visible element that shows text (headings,
table cells, labels, buttons, legend entries, figure captions, facts, notes): the element's
box joined with its text's own extent (a text wider than its box overflows it), clipped by
every ancestor that clips (a table scrolling inside its panel shows only what is inside the
panel). :func:`overlaps` compares them pairwise, ignoring an element and its ancestors.
"""

from __future__ import annotations

from typing import Any

TEXT = (
    "h1, h2, h3, th, td, label, button, legend, figcaption, .legend li, .axis-text span, "
    "dt, dd, p, pre, nav a, #conn-state, #updated, .figure .label, .figure .value"
)

TEXT_BOXES = """sel => {
  const clips = (el) => {
    const out = [];
    for (let a = el.parentElement; a; a = a.parentElement) {
      const cs = getComputedStyle(a);
      const clipping = cs.overflowX !== "visible" || cs.overflowY !== "visible";
      if (clipping) out.push(a.getBoundingClientRect());
    }
    return out;
  };
  const boxes = [];
  const all = [...document.querySelectorAll(sel)];
  all.forEach((el, i) => {
    if (!el.textContent.trim()) return;
    if (!el.getClientRects().length) return;  // not rendered (hidden, display: none)
    const cs = getComputedStyle(el);
    if (cs.visibility === "hidden") return;
    const r = el.getBoundingClientRect();
    let box = {l: r.left, t: r.top, r: r.right, b: r.bottom};
    const range = document.createRange();
    range.selectNodeContents(el);
    const t = range.getBoundingClientRect();
    if (t.width > 0 && t.height > 0 && cs.overflowX === "visible") {
      box = {l: Math.min(box.l, t.left), t: Math.min(box.t, t.top),
             r: Math.max(box.r, t.right), b: Math.max(box.b, t.bottom)};
    }
    for (const c of clips(el)) {
      box = {l: Math.max(box.l, c.left), t: Math.max(box.t, c.top),
             r: Math.min(box.r, c.right), b: Math.min(box.b, c.bottom)};
    }
    if (box.r - box.l < 1 || box.b - box.t < 1) return;  // scrolled or clipped out of view
    // A text that leaves its panel (a table wider than the panel, not scrolling in it).
    const panel = el.closest(".panel");
    let outside = false;
    if (panel) {
      const p = panel.getBoundingClientRect();
      outside = box.l < p.left - 1 || box.r > p.right + 1
        || box.t < p.top - 1 || box.b > p.bottom + 1;
    }
    const cls = typeof el.className === "string" && el.className
      ? "." + el.className.split(" ").join(".") : "";
    const name = el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + cls;
    boxes.push({i, name, outside, text: el.textContent.trim().slice(0, 40),
                l: box.l + scrollX, t: box.t + scrollY, r: box.r + scrollX, b: box.b + scrollY});
  });
  // Pairs where one holds the other are not overlaps: mark each box's ancestors among them.
  const index = new Map(all.map((el, i) => [el, i]));
  for (const b of boxes) {
    b.up = [];
    for (let a = all[b.i].parentElement; a; a = a.parentElement) {
      if (index.has(a)) b.up.push(index.get(a));
    }
  }
  return boxes;
}"""

#: Pixels two boxes may share (borders of adjacent table cells touch, rounding).
SLACK = 1.0


def overlaps(boxes: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of boxes (described) that overlap by more than :data:`SLACK` both ways."""
    found = []
    for n, a in enumerate(boxes):
        for b in boxes[n + 1 :]:
            if a["i"] in b["up"] or b["i"] in a["up"]:
                continue
            w = min(a["r"], b["r"]) - max(a["l"], b["l"])
            h = min(a["b"], b["b"]) - max(a["t"], b["t"])
            if w > SLACK and h > SLACK:
                found.append((f"{a['name']} {a['text']!r}", f"{b['name']} {b['text']!r}"))
    return found


def check_layout(page: Any, width: int) -> list[tuple[str, str]]:
    """The page's overlapping text pairs, texts that leave their panel, and a sideways spill
    of the whole page past ``width`` (the window's width in CSS pixels) if any."""
    boxes = page.evaluate(TEXT_BOXES, TEXT)
    found = overlaps(boxes)
    found += [(f"{b['name']} {b['text']!r}", "leaves its panel") for b in boxes if b["outside"]]
    wide = page.evaluate("document.documentElement.scrollWidth")
    if wide > width + 1:
        found.append(("the page", f"is {wide} px wide in a window of {width} px"))
    return found
