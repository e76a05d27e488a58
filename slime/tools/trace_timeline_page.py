"""The page of slime.tools.trace_timeline_viewer: one self-contained HTML document (its style and
script inline, no network), into which the viewer puts the title (`__TITLE__`) and the timeline
cache as JSON. Kept apart from the viewer's Python: the page is read by a browser, the rest of
the tool by people."""

HTML_TEMPLATE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  :root { --lane: 20px; --label: 190px; --line: #d5d9e0; --muted: #667085; }
  * { box-sizing: border-box; }
  body { margin: 0; height: 100vh; display: flex; flex-direction: column;
         font: 13px/1.35 system-ui, sans-serif; color: #1d2330; }
  header { display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: baseline;
           padding: 8px 12px; border-bottom: 1px solid var(--line); }
  h1 { font-size: 15px; margin: 0; }
  #summary, .hint, .muted { color: var(--muted); }
  #notice, .warn { padding: 8px 10px; background: #fff4e5; border: 1px solid #f0c27b; border-radius: 4px; }
  #notice { margin: 12px; }
  main { flex: 1; display: flex; min-height: 0; }
  #timeline { flex: 1; overflow: auto; }
  #details { width: 360px; flex: none; overflow: auto; padding: 8px 12px;
             border-left: 1px solid var(--line); background: #fafbfc; }
  .row { display: flex; min-width: max-content; border-bottom: 1px solid #eef0f3; }
  .axis { position: sticky; top: 0; z-index: 3; height: 24px; background: #fff;
          border-bottom: 1px solid #c4c9d2; }
  .label { position: sticky; left: 0; z-index: 2; width: var(--label); flex: none; padding: 3px 8px;
           background: #fff; border-right: 1px solid var(--line); cursor: pointer;
           white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
  .track { position: relative; flex: none; }
  .tick { position: absolute; top: 0; bottom: 0; padding: 4px 0 0 3px; border-left: 1px solid #c4c9d2;
          font-size: 11px; color: var(--muted); white-space: nowrap; }
  .bar { position: absolute; height: calc(var(--lane) - 4px); min-width: 2px; padding: 0 4px;
         border: 1px solid rgba(0, 0, 0, .25); border-radius: 3px; cursor: pointer; overflow: hidden;
         font-size: 11px; line-height: calc(var(--lane) - 6px); white-space: nowrap; }
  .bar.open { border-right: 3px dashed #b42318;
              background-image: repeating-linear-gradient(135deg, transparent 0 6px,
                                                          rgba(255, 255, 255, .6) 6px 9px); }
  .point { position: absolute; width: 10px; height: 10px; margin-left: -5px; transform: rotate(45deg);
           background: #1d2330; cursor: pointer; }
  .point.orphan_end { background: #b42318; }
  .selected { outline: 2px solid #1d4ed8; outline-offset: 1px; z-index: 1; }
  h2 { font-size: 14px; margin: 6px 0; word-break: break-all; }
  h3 { font-size: 12px; margin: 10px 0 2px; color: #344054; }
  table { width: 100%; border-collapse: collapse; }
  td { padding: 2px 4px; border-top: 1px solid #e4e7ec; vertical-align: top; word-break: break-word; }
  td:first-child { width: 45%; color: var(--muted); }
</style>
</head>
<body>
<header>
  <h1>__TITLE__</h1>
  <span id="summary"></span>
  <label>filter <input id="filter" type="search" placeholder="sample, group, status or span name"></label>
  <label>zoom <input id="zoom" type="range" min="1" max="50" value="1"></label>
</header>
__NOTICE__
<main>
  <div id="timeline">
    <div class="row axis">
      <div class="label">time since first event</div><div class="track" id="axis"></div>
    </div>
    <div id="rows"></div>
  </div>
  <aside id="details">
    <p class="hint">Click a span (bar) or an event (diamond) to see what was recorded with it;
      click a sample's label for the sample. Nested spans sit one lane below their parent.</p>
  </aside>
</main>
<script type="application/json" id="trace-data">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("trace-data").textContent);
const LANE = 20;
const CLIPPED = {row_end: "last event of this sample", next_sibling_start: "start of the next span beside it",
                 ancestor_end: "end of the span that contains it"};
const $ = (id) => document.getElementById(id);
const t0 = data.global_start ?? 0;
const range = Math.max((data.global_end ?? 0) - t0, 1e-6);
let width = 0;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function color(name) {
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360} 62% 74%)`;
}
function secs(s) {
  if (s === null || s === undefined) return "—";
  const a = Math.abs(s);
  if (a === 0) return "0 s";
  if (a < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  return a < 1 ? `${(s * 1e3).toFixed(2)} ms` : `${s.toFixed(3)} s`;
}
const at = (ts) => (ts === null || ts === undefined ? "—" : `+${secs(ts - t0)}`);
const x = (ts) => ((ts - t0) / range) * width;
const text = (v) => (typeof v === "object" && v !== null ? JSON.stringify(v) : String(v));

function table(obj) {
  const t = el("table");
  for (const [k, v] of Object.entries(obj)) {
    const tr = el("tr");
    tr.append(el("td", "", k), el("td", "", text(v)));
    t.append(tr);
  }
  return t;
}
function attrs(title, obj) {
  const empty = !obj || !Object.keys(obj).length;
  return [el("h3", "", title), empty ? el("p", "muted", "none") : table(obj)];
}
function select(node, contents) {
  document.querySelectorAll(".selected").forEach((n) => n.classList.remove("selected"));
  node.classList.add("selected");
  $("details").replaceChildren(...contents);
}

function itemDetails(row, item) {
  const facts = {sample: row.sample_index, kind: item.state.replace("_", " ")};
  if (item.type === "span") {
    const open = item.end_ts === null;
    Object.assign(facts, {start: at(item.start_ts), end: open ? "none recorded" : at(item.end_ts),
                          duration: (open ? "at least " : "") + secs(item.duration)});
  } else {
    facts.at = at(item.ts);
  }
  Object.assign(facts, {parent: item.parent_span_name ?? "—", depth: item.depth, attempt: item.attempt});
  if (item.span_id) facts.span_id = item.span_id;
  const out = [el("h2", "", item.name), table(facts)];
  if (item.state === "open_span") {
    const to = CLIPPED[item.attrs.end_attrs.clipped_by] ?? "last event of this sample";
    const why = `Open: a span_start without its span_end (a partial trace); drawn up to the ${to}.`;
    out.push(el("p", "warn", why));
  }
  if (item.state === "orphan_end") {
    out.push(el("p", "warn", "A span_end without its span_start (a partial trace)."));
  }
  if (item.type === "span") {
    out.push(...attrs("attrs at start", item.attrs.start_attrs),
             ...attrs("attrs at end", item.attrs.end_attrs));
  } else {
    out.push(...attrs("attrs", item.attrs));
  }
  return out;
}
function sampleDetails(row) {
  return [el("h2", "", `sample ${row.sample_index}`), table({
    group: row.group_index, status: row.status, reward: row.reward, label: row.label, trace_id: row.trace_id,
    attempt: row.attempt, start: at(row.start), duration: secs(row.duration),
    "closed spans": row.closed_span_count, "open spans": row.open_span_count,
    events: row.point_event_count, "unmatched ends": row.orphan_count})];
}

function mark(row, item) {
  const isSpan = item.type === "span";
  const node = el("div", isSpan ? `bar${item.state === "open_span" ? " open" : ""}` : `point ${item.state}`,
                  isSpan ? item.name : undefined);
  const top = 2 + item.lane * LANE;
  if (isSpan) {
    node.style.left = `${x(item.start_ts)}px`;
    node.style.width = `${Math.max(2, x(item.display_end_ts) - x(item.start_ts))}px`;
    node.style.top = `${top}px`;
    node.style.backgroundColor = color(item.name);
  } else {
    node.style.left = `${x(item.ts)}px`;
    node.style.top = `${top + (LANE - 14) / 2}px`;
  }
  node.title = isSpan ? `${item.name} (${secs(item.duration)})` : item.name;
  node.dataset.name = item.name;
  node.onclick = () => select(node, itemDetails(row, item));
  return node;
}
function matches(row, query) {
  const words = [`sample ${row.sample_index}`, `group ${row.group_index}`, text(row.status),
                 ...row.items.map((i) => i.name)];
  return !query || words.some((w) => w.toLowerCase().includes(query));
}
function drawAxis() {
  const axis = $("axis");
  axis.replaceChildren();
  axis.style.width = `${width}px`;
  const wanted = range / Math.max(1, width / 110);
  const power = 10 ** Math.floor(Math.log10(wanted));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= wanted);
  for (let i = 0; i * step <= range * (1 + 1e-9); i++) {
    const tick = el("div", "tick", `+${secs(i * step)}`);
    tick.style.left = `${((i * step) / range) * width}px`;
    axis.append(tick);
  }
}
function draw() {
  const label = document.querySelector(".label").offsetWidth;
  width = Math.max(200, ($("timeline").clientWidth - label - 16) * Number($("zoom").value));
  drawAxis();
  const query = $("filter").value.trim().toLowerCase();
  const rows = $("rows");
  rows.replaceChildren();
  for (const row of data.rows.filter((r) => matches(r, query))) {
    const line = el("div", "row");
    line.dataset.sample = row.sample_index;
    const name = el("div", "label");
    name.append(el("b", "", `sample ${row.sample_index}`), el("br"),
                el("span", "muted", `group ${row.group_index ?? "?"} · reward ${text(row.reward)}`));
    name.onclick = () => select(name, sampleDetails(row));
    const track = el("div", "track");
    track.style.width = `${width}px`;
    track.style.height = `${row.lane_count * LANE + 4}px`;
    track.append(...row.items.map((item) => mark(row, item)));
    line.append(name, track);
    rows.append(line);
  }
}

if (data.rows.length) {
  const n = data.rows.length;
  $("summary").textContent = `${n} traced sample${n === 1 ? "" : "s"} of ${data.dump_sample_count ?? n} · ` +
    `${secs(range)} from the first event to the last`;
  for (const id of ["filter", "zoom"]) $(id).addEventListener("input", draw);
  window.addEventListener("resize", draw);
  draw();
} else {
  $("timeline").hidden = true;
  $("details").hidden = true;
}
</script>
</body>
</html>
"""
