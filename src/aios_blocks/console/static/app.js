// aios-blocks console: plain JavaScript, no build step, no library (docs/console.md says why).
// Every piece of user text goes into the page through textContent (el() below), never innerHTML.
"use strict";

const params = new URLSearchParams(location.search);
const PAST = params.has("seq") ? params.get("seq") : null;
const state = { admin: false, actions: false, lastSeq: 0, view: "", refresh: null, blocksQuery: { q: "", status: "", cluster: "", tenant: "", priority: "", label: "", policy: "", page: 0 }, sparks: null };

// -- the admin token: given once as #token=..., kept for this tab only ------------------------------
if (location.hash.startsWith("#token=")) {
  sessionStorage.setItem("aios-console-token", decodeURIComponent(location.hash.slice(7)));
  history.replaceState(null, "", location.pathname + location.search + "#/");
}
const token = () => sessionStorage.getItem("aios-console-token") || "";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// replaceChildren without the absent parts (a bare null would show as the text "null")
// (a field being typed in that a redraw takes away says change then: `replacing` tells its handler
// that nobody pressed Enter or left it, render() keeps its text in the new field)
let replacing = false;
function put(node, ...children) {
  replacing = true;
  try { node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false)); } finally { replacing = false; }
}

function withSeq(url) {
  if (PAST === null) return url;
  return url + (url.includes("?") ? "&" : "?") + "seq=" + encodeURIComponent(PAST);
}

async function api(url) {
  const headers = token() ? { "X-Console-Token": token() } : {};
  const r = await fetch(withSeq(url), { headers });
  if (!r.ok) { const e = failure(r, await r.text()); e.status = r.status; throw e; }
  return r.json();
}

// an error answer's reason: the server answers {"error": ..., "status": ...} (runtime/httperrors.py)
function failure(r, text) {
  try {
    const body = JSON.parse(text);
    if (body && typeof body.error === "string") return new Error(body.error);
  } catch (e) { /* not JSON: the text as it is */ }
  return new Error(text || r.statusText);
}

async function action(url, body) {
  const r = await fetch(url, {
    method: "POST", headers: { "Content-Type": "application/json", "X-Console-Token": token() }, body: JSON.stringify(body || {}),
  });
  const text = await r.text();
  if (!r.ok) throw failure(r, text);
  return JSON.parse(text);
}

const statusTag = (s) => el("span", { class: "status " + s }, s || "-");
const blockLink = (bid) => el("a", { href: "#/block/" + encodeURIComponent(bid) }, bid);
const fmtTime = (ts) => (ts ? new Date(ts * 1000).toISOString().slice(11, 23) : "");

function table(head, rows, id) {
  return el("table", { id }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

// -- views ------------------------------------------------------------------------------------------
async function viewOverview(root) {
  const o = await api("/api/overview");
  const t = o.totals;
  const card = (n, k, id) => el("div", { class: "card", id }, el("div", { class: "n" }, n), el("div", { class: "k" }, k));
  put(root, 
    el("h2", {}, "Overview"),
    el("div", { class: "cards", id: "overview-cards" },
      card(o.clusters.length, "clusters", "ov-clusters"), card(t.nodes || 0, "nodes", "ov-nodes"), card(t.gpus || 0, "GPUs", "ov-gpus"),
      card(t.used || 0, "GPUs used", "ov-used"), card(t.free || 0, "GPUs free", "ov-free"),
      card(t.stranded || 0, "GPUs stranded (FGD)", "ov-stranded"),
      card(o.rates.placements_per_s ?? "-", "placements/s", "ov-placements"), card(o.rates.events_per_s ?? "-", "block events/s", "ov-events")),
    el("h3", {}, "Blocks by status"),
    Object.keys(o.blocks).length ? el("div", { class: "cards", id: "ov-status" }, Object.entries(o.blocks).map(([s, n]) => card(n, s)))
      : el("p", { class: "muted", id: "ov-status" }, PAST === null ? "No block yet: `blocks submit SPEC` (examples/block.yaml) sends one." : "no block then"),
    el("h3", {}, "Clusters"),
    o.clusters.length ? table(["cluster", "nodes", "healthy", "drained", "GPUs", "used", "free", "stranded"],
      o.clusters.map((c) => el("tr", { dataset: { cluster: c.id } }, [c.id, c.nodes, c.healthy, c.drained, c.gpus, c.used, c.free, c.stranded].map((v) => el("td", {}, v)))), "ov-clusters-table")
      : el("p", { class: "muted", id: "ov-clusters-table" }, PAST === null ? NO_CLUSTER : "no cluster then"),
    el("h3", {}, "Pending queue"),
    o.pending.length ? table(["block", "name", "status", "since", "why it waits"], o.pending.map((b) => el("tr", {},
      el("td", {}, blockLink(b.id)), el("td", {}, b.name), el("td", {}, statusTag(b.status)), el("td", {}, fmtTime(b.created)),
      el("td", { class: "reason" }, b.reason))), "ov-pending") : el("p", { class: "muted" }, "nothing waiting"),
    el("h3", {}, "Recent failures"),
    o.failures.length ? table(["block", "name", "status", "reason"], o.failures.map((b) => el("tr", {},
      el("td", {}, blockLink(b.id)), el("td", {}, b.name), el("td", {}, statusTag(b.status)), el("td", { class: "reason" }, b.reason))), "ov-failures") : el("p", { class: "muted" }, "none"),
  );
}

const NO_CLUSTER = "No cluster yet: `blocks cluster add c1 --nodes 2 --gpus 4` registers a simulated one, `blocks cluster import FILE --cluster NAME` an inventory.";

const CELL = 7, GAP = 1, PAD = 2, PER_ROW = 8, TILE_GAP = 4, HEADER = 20;

function cellColour(alloc, strandedNode) {
  if (alloc >= 1000) return "#c0392b";
  if (alloc > 0) {
    const a = alloc / 1000; // green -> orange -> red by the share held
    return `rgb(${Math.round(230 + 20 * a)},${Math.round(200 - 120 * a)},${Math.round(90 - 40 * a)})`;
  }
  return strandedNode ? "#b9a6e3" : "#bfe3c6";
}

const RACK_HEADER = 16, DRAINED = "#e0a526";

// Tiles in groups: a title per cluster and GPU model, and within it one per rack (the nodes'
// `rack` label) when the nodes have one; each rack starts a new line.
function layoutMap(nodes, width) {
  const tiles = [], headers = [];
  let x = 0, y = 0, rowH = 0, group = null, rack = null;
  const newLine = () => { if (x > 0) { y += rowH + TILE_GAP; } x = 0; rowH = 0; };
  for (const n of nodes) {
    const [, cluster, model, , nodeRack] = n;
    const key = cluster + "\u0000" + model;
    if (key !== group) {
      newLine();
      group = key; rack = null;
      headers.push({ y, text: `${cluster} \u00b7 ${model}`, kind: "group" });
      y += HEADER;
    }
    if (nodeRack && nodeRack !== rack) {
      newLine();
      rack = nodeRack;
      headers.push({ y, text: `rack ${nodeRack}`, kind: "rack" });
      y += RACK_HEADER;
    }
    const g = n[5].length, cols = Math.max(1, Math.min(g, PER_ROW)), rows = Math.max(1, Math.ceil(g / PER_ROW));
    const w = cols * (CELL + GAP) - GAP + 2 * PAD, h = rows * (CELL + GAP) - GAP + 2 * PAD;
    if (x + w > width) { x = 0; y += rowH + TILE_GAP; rowH = 0; }
    tiles.push({ x, y, w, h, n });
    x += w + TILE_GAP; rowH = Math.max(rowH, h);
  }
  return { tiles, headers, height: y + rowH + TILE_GAP };
}

const MAP_FILTERS = ["label", "tenant", "priority"];

async function viewMap(root) {
  const hashQuery = new URLSearchParams(location.hash.split("?")[1] || "");
  const f = Object.fromEntries(MAP_FILTERS.map((k) => [k, hashQuery.get(k) || ""]));
  const qs = new URLSearchParams(Object.entries(f).filter(([, v]) => v));
  // live: the map held is brought up to date with the nodes changed since its sequence (a delta)
  const held = PAST === null && state.map && state.map.filters === qs.toString() ? state.map : null;
  if (held) qs.set("since", held.seq);
  const m = await api("/api/gpumap" + (qs.toString() ? "?" + qs : ""));
  const changed = m.nodes.length;
  if (m.delta && held) {
    const byId = new Map(held.nodes.map((n) => [n[0], n]));
    for (const id of m.gone) byId.delete(id);
    for (const n of m.nodes) byId.set(n[0], n);
    const key = (n) => [n[1], n[2], n[4], n[0]];
    m.nodes = [...byId.values()].sort((a, b) => { const x = key(a), y = key(b); for (let i = 0; i < 4; i++) { if (x[i] < y[i]) return -1; if (x[i] > y[i]) return 1; } return 0; });
  }
  if (PAST === null) state.map = { filters: new URLSearchParams(Object.entries(f).filter(([, v]) => v)).toString(), seq: m.seq, nodes: m.nodes };
  const width = Math.max(600, Math.min(1400, root.clientWidth - 420));
  const { tiles, headers, height } = layoutMap(m.nodes, width);
  const used = m.nodes.reduce((a, n) => a + n[5].filter((c) => c > 0).length, 0);
  const canvas = el("canvas", { id: "gpu-canvas", width, height, dataset: { nodes: m.nodes.length, gpus: m.gpus, marked: m.marked, used, drained: m.nodes.filter((n) => n[8]).length, seq: m.seq, sent: changed, delta: m.delta ? 1 : 0 } });
  const ctx = canvas.getContext("2d");
  for (const h of headers) {
    ctx.font = h.kind === "rack" ? "11px system-ui, sans-serif" : "bold 12px system-ui, sans-serif";
    ctx.fillStyle = h.kind === "rack" ? "#6b7385" : "#1d2330";
    ctx.fillText(h.text, h.kind === "rack" ? 8 : 2, h.y + (h.kind === "rack" ? 12 : 14));
  }
  for (const t of tiles) {
    const [, , , healthy, , cells, stranded, marked, drained] = t.n;
    ctx.fillStyle = !healthy ? "#5b6170" : drained ? DRAINED : "#e9ecf2";
    ctx.fillRect(t.x, t.y, t.w, t.h);
    cells.forEach((a, i) => {
      const cx = t.x + PAD + (i % PER_ROW) * (CELL + GAP), cy = t.y + PAD + Math.floor(i / PER_ROW) * (CELL + GAP);
      ctx.fillStyle = cellColour(a, stranded > 0);
      ctx.fillRect(cx, cy, CELL, CELL);
      if (marked && marked.includes(i)) { ctx.strokeStyle = "#1d4ed8"; ctx.lineWidth = 2; ctx.strokeRect(cx + 1, cy + 1, CELL - 2, CELL - 2); }
    });
  }
  const panel = el("div", { id: "gpu-panel" }, el("p", { class: "muted" }, "Click a GPU to see its instances and their blocks."));
  canvas.addEventListener("click", (ev) => {
    const r = canvas.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top;
    const t = tiles.find((t) => px >= t.x && px < t.x + t.w && py >= t.y && py < t.y + t.h);
    if (!t) return;
    const i = Math.floor((px - t.x - PAD) / (CELL + GAP)) + PER_ROW * Math.floor((py - t.y - PAD) / (CELL + GAP));
    state.gpuPick = { route: location.hash, node: t.n[0], i };
    showGpu(panel, t.n[0], i);
  });
  // a live redraw keeps the GPU that was clicked, its instances read again
  if (state.gpuPick && state.gpuPick.route === location.hash) {
    const before = document.getElementById("gpu-panel");
    if (before) panel.replaceChildren(...before.childNodes); // (no flash of the hint while it is read)
    showGpu(panel, state.gpuPick.node, state.gpuPick.i);
  }
  const inputs = {
    label: el("input", { id: "map-label", placeholder: "label key=value", value: f.label }),
    tenant: el("input", { id: "map-tenant", placeholder: "tenant", value: f.tenant, size: 12 }),
    priority: el("input", { id: "map-priority", placeholder: "priority class", value: f.priority, size: 12 }),
  };
  const apply = () => {
    const next = new URLSearchParams(MAP_FILTERS.map((k) => [k, inputs[k].value.trim()]).filter(([, v]) => v));
    location.hash = "#/map" + (next.toString() ? "?" + next : "");
  };
  for (const i of Object.values(inputs)) i.addEventListener("change", () => { if (!replacing) apply(); });
  const groups = el("ul", { id: "map-groups", class: "groups" }, m.groups.map((g) => el("li", { dataset: { cluster: g.cluster, model: g.model, rack: g.rack } },
    `${g.cluster} \u00b7 ${g.model}` + (g.rack ? ` \u00b7 rack ${g.rack}` : ""), el("span", { class: "muted" }, ` ${g.nodes} nodes, ${g.gpus} GPUs`))));
  const filtered = f.tenant || f.priority;
  put(root, 
    el("h2", {}, "GPU map"),
    el("div", { class: "toolbar" }, el("span", { id: "map-summary" }, `${m.nodes.length} nodes, ${m.gpus} GPUs`),
      filtered ? el("span", { id: "map-marked", class: "muted" }, `(${m.marked} held by the filter's blocks, outlined)`) : null,
      inputs.label, inputs.tenant, inputs.priority, el("span", { class: "legend" }, ...legend())),
    m.nodes.length ? null : el("p", { class: "muted", id: "map-empty" }, f.label || filtered ? "No node matches these filters."
      : PAST === null ? NO_CLUSTER : "No node then."),
    el("div", { id: "map-wrap" }, canvas, el("div", { class: "side" }, panel, el("h3", {}, "Groups"), groups)),
  );
}

// the panel beside the map: one GPU's instances and their blocks (read when clicked, and again on
// each live redraw while it stays picked)
async function showGpu(panel, node, i) {
  let d;
  try { d = await api("/api/gpu?node=" + encodeURIComponent(node)); } catch (e) {
    put(panel, el("h3", {}, "node ", node), el("p", { class: "reason", id: "gpu-instances" }, "could not load: ", e.message));
    return;
  }
  const gpu = d.gpus[Math.max(0, Math.min(i, d.gpus.length - 1))];
  const on = gpu ? d.instances.filter((x) => x.gpus.includes(gpu.id)) : d.instances;
  put(panel,
    el("h3", {}, "node ", d.node), el("div", { class: "muted" }, `cluster ${d.cluster} \u00b7 ${d.healthy ? "healthy" : "unhealthy"}${d.drain ? " \u00b7 drained (blocks node drain): nothing new is placed here" : ""} \u00b7 CPU ${d.cpu_used}/${d.cpu}` + (d.labels.rack ? ` \u00b7 rack ${d.labels.rack}` : "")),
    gpu ? el("p", {}, el("strong", {}, "GPU ", gpu.id), ` ${gpu.model}, ${gpu.memory} MiB, held ${(gpu.alloc / 10).toFixed(1)} %`) : null,
    on.length ? table(["instance", "block", "status"], on.map((x) => el("tr", {}, el("td", {}, x.instance),
      el("td", {}, blockLink(x.block), x.name ? el("div", { class: "muted" }, x.name) : null), el("td", {}, x.status))), "gpu-instances") : el("p", { class: "muted", id: "gpu-instances" }, "no instance on it"),
  );
}

function legend() {
  const item = (c, t) => { const s = el("span"); s.style.background = c; return [s, t]; };
  return [...item("#bfe3c6", "free"), ...item("#b9a6e3", "free, stranded"), ...item(cellColour(500, false), "shared"), ...item("#c0392b", "held whole"), ...item(DRAINED, "drained node"), ...item("#5b6170", "unhealthy node")];
}

// a filter's choices, keeping the chosen one even when no block has it any more
const withCurrent = (values, current) => (current && !values.includes(current) ? [...values, current] : values);

async function viewBlocks(root) {
  const bq = state.blocksQuery;
  const qs = new URLSearchParams({ q: bq.q, status: bq.status, cluster: bq.cluster, tenant: bq.tenant, priority: bq.priority, label: bq.label, policy: bq.policy, page: bq.page, per: 50 });
  // a filter the server refuses (400: a label that is no key=value) is said under the filters,
  // which stay to be corrected; it replaced the whole page, kept in the query, until a reload
  let d, refused = "";
  try {
    d = await api("/api/blocks?" + qs);
    state.blocksLists = d;
  } catch (e) {
    if (e.status !== 400) throw e;
    refused = e.message;
    const was = state.blocksLists || {};
    d = { total: 0, per: 50, page: 0, rows: [], statuses: was.statuses || [], clusters: was.clusters || [], tenants: was.tenants || [], priorities: was.priorities || [] };
  }
  const search = el("input", { id: "blocks-search", placeholder: "search id, name, component", value: bq.q });
  let timer = null;
  // (the query is kept at once: a live redraw meanwhile keeps what was typed)
  search.addEventListener("input", () => { bq.q = search.value; bq.page = 0; clearTimeout(timer); timer = setTimeout(render, 250); });
  const select = (id, values, current, key) => {
    const s = el("select", { id }, el("option", { value: "" }, "all"), values.map((v) => el("option", { value: v, selected: v === current }, v)));
    s.addEventListener("change", () => { bq[key] = s.value; bq.page = 0; render(); });
    return s;
  };
  const field = (id, key, placeholder) => {
    const f = el("input", { id, placeholder, value: bq[key], size: 16 });
    f.addEventListener("change", () => { if (!replacing) { bq[key] = f.value.trim(); bq.page = 0; render(); } });
    return f;
  };
  const pages = Math.max(1, Math.ceil(d.total / d.per));
  const pager = el("div", { class: "pager" },
    el("button", { id: "prev", disabled: d.page <= 0, on: { click: () => { bq.page--; render(); } } }, "\u2039 prev"),
    el("span", { id: "page-info" }, `page ${d.page + 1} of ${pages} \u00b7 ${d.total} blocks`),
    el("button", { id: "next", disabled: d.page + 1 >= pages, on: { click: () => { bq.page++; render(); } } }, "next \u203a"));
  const typing = document.activeElement && document.activeElement.id === "blocks-search";
  put(root, 
    el("h2", {}, "Blocks"),
    el("div", { class: "toolbar" }, search, "status", select("status-filter", withCurrent(d.statuses, bq.status), bq.status, "status"), "cluster", select("cluster-filter", withCurrent(d.clusters, bq.cluster), bq.cluster, "cluster"),
      "tenant", select("tenant-filter", withCurrent(d.tenants, bq.tenant), bq.tenant, "tenant"),
      "priority", select("priority-filter", withCurrent(d.priorities, bq.priority), bq.priority, "priority"),
      field("label-filter", "label", "label key=value"), field("policy-filter", "policy", "policy URI")),
    table(["block", "name", "status", "cluster", "tenant", "priority", "instances", "component", "reason"], d.rows.map((b) => el("tr", { dataset: { bid: b.id } },
      el("td", {}, blockLink(b.id)), el("td", { class: "name" }, b.name), el("td", {}, statusTag(b.status)), el("td", {}, b.cluster),
      el("td", { class: "tenant" }, b.tenant || ""), el("td", { class: "priority" }, b.priority || ""),
      el("td", {}, `${b.running}/${b.desired}`), el("td", {}, b.component), el("td", { class: "reason" }, b.short || b.reason))), "blocks-table"),
    refused ? el("p", { class: "reason", id: "blocks-refused" }, "filter refused: ", refused, " (correct it above)") : null,
    d.rows.length || refused ? null : el("p", { class: "muted", id: "blocks-empty" }, [bq.q, bq.status, bq.cluster, bq.tenant, bq.priority, bq.label, bq.policy].some((v) => v)
      ? "No block matches these filters." : PAST === null ? "No block yet: `blocks submit SPEC` (examples/block.yaml) sends one." : "No block then."),
    pager,
  );
  if (typing) { search.focus(); search.setSelectionRange(search.value.length, search.value.length); }
}

function explainList(x) {
  const items = [];
  if (x.reason) items.push(el("li", {}, el("strong", {}, "reason: "), x.reason));
  for (const r of x.rounds || []) {
    items.push(el("li", {}, `round ${r.round}: candidates ${JSON.stringify(r.candidates)}`));
    for (const [c, why] of Object.entries(r.filtered || {})) items.push(el("li", { class: "lost" }, `cluster ${c} filtered: ${typeof why === "string" ? why : JSON.stringify(why)}`));
    for (const [c, a] of Object.entries(r.dry_run || {})) {
      items.push(el("li", {}, `cluster ${c}: dry_run score ${a.score}` + (a.node ? ` on ${a.node} ${JSON.stringify(a.gpus)}` : "") + (a.error ? ` \u2014 ${a.error}` : "")));
      for (const [n, why] of Object.entries(a.rejected_nodes || {})) items.push(el("li", { class: "lost" }, `  node ${n} lost: ${typeof why === "string" ? why : JSON.stringify(why)}`));
    }
    if (r.chosen) items.push(el("li", {}, el("strong", {}, `chosen ${r.chosen}`), r.why ? `: ${r.why}` : ""));
  }
  for (const f of x.failures || []) items.push(el("li", { class: "lost" }, "failure: ", typeof f === "string" ? f : JSON.stringify(f)));
  for (const t of x.targets || []) items.push(el("li", {}, "target: ", JSON.stringify(t)));
  for (const d of (x.autoscaler || {}).decisions || []) items.push(el("li", {}, "autoscaler: ", JSON.stringify(d)));
  return el("ul", { class: "why", id: "explain" }, items.length ? items : el("li", { class: "muted" }, "no decision recorded yet"));
}

async function viewBlock(root, bid) {
  let d;
  try { d = await api("/api/block/" + encodeURIComponent(bid)); } catch (e) {
    if (e.status !== 404) throw e;
    put(root, el("h2", {}, "Block ", el("span", { id: "block-id" }, bid)),
      el("p", { id: "block-missing" }, PAST === null ? `No block ${bid} in this system (a mistyped id?): ` : `No block ${bid} at sequence ${PAST} (created later, or never): `,
        el("a", { href: "#/blocks" }, "the Blocks page"), " lists them."));
    return;
  }
  const b = d.block;
  // the sparklines keep their own refresh (every 2 s): the samples are not in the stream
  const sparks = el("div", { class: "sparks", id: "sparks" }, el("p", { class: "muted" }, PAST === null ? "" : "live only: the metrics are not in the stream"));
  if (PAST === null) {
    const tick = () => drawSparks(sparks, bid).catch((e) => put(sparks, el("p", { class: "muted" }, "no metrics: ", e.message)));
    tick();
    clearInterval(state.sparks);
    state.sparks = setInterval(() => { if (document.getElementById("sparks") === sparks) tick(); else clearInterval(state.sparks); }, 2000);
  }
  const acts = [];
  const admin = state.admin && state.actions && PAST === null && !["deleted", "deleting", "rejected"].includes(b.status);
  let run = null;
  if (admin) {
    const target = el("input", { id: "scale-target", type: "number", min: 0, value: (b.desired || 0) + 1, class: "narrow" });
    // (kept across the re-renders the action's own events cause)
    const msg = el("span", { id: "action-result", class: "muted" }, state.lastAction && state.lastAction.bid === bid ? state.lastAction.text : "");
    run = async (what, url, body, detail) => {
      if (!confirm(`${what} ${body.instance ? "instance " + body.instance + " of " : ""}block ${bid}${detail || ""}?`)) return;
      let text;
      // (a scale's answer says what the block will reach when it was clamped: '0 raised to minInstances 2')
      try { const r = await action(url, body); text = `${what} requested (${r.request})` + (r.note ? `: ${r.note}` : ""); } catch (e) { text = `${what} refused: ${e.message}`; }
      state.lastAction = { bid, text };
      msg.textContent = text;
    };
    acts.push(el("div", { class: "actions", id: "actions" }, el("strong", {}, "admin"), "scale to", target,
      el("button", { id: "scale-btn", on: { click: () => {
        // (an emptied field is no count: Number("") is 0, a scale to nothing; the server clamps to maxInstances)
        const n = target.value.trim();
        if (!/^\d+$/.test(n)) { msg.textContent = "scale: give a whole number of instances, 0 or more"; return; }
        msg.textContent = "";
        // (the controller clamps to [minInstances, maxInstances]: a block of minInstances 2 asked for 0
        // keeps 2 and keeps serving, so only a target that stays 0 'stops serving')
        const lo = d.ir.minInstances, hi = d.ir.maxInstances, want = Number(n);
        const clamp = hi != null && want > hi ? ` (its maxInstances is ${hi}: it gets ${hi})`
          : lo != null && want < lo ? ` (its minInstances is ${lo}: it gets ${lo})` : "";
        const gets = hi != null && want > hi ? hi : lo != null && want < lo ? lo : want;
        run("scale", `/api/block/${encodeURIComponent(bid)}/scale`, { target: want },
          ` to ${want} instance${want === 1 ? "" : "s"}, from ${b.desired ?? 0}` + (gets === 0 && (b.desired ?? 0) > 0 ? ": it stops serving" : "") + clamp);
      } } }, "scale"),
      el("button", { id: "delete-btn", on: { click: () => run("delete", `/api/block/${encodeURIComponent(bid)}/delete`, {}) } }, "delete"), msg));
  } else if (PAST === null && !["deleted", "deleting", "rejected"].includes(b.status)) {
    // an observer is told why there is no action, and how to get them
    acts.push(el("p", { class: "muted", id: "actions-hint" }, !state.actions
      ? "Scale, reassign and delete: this console has no admin credentials (use the CLI)."
      : token()
        ? "Scale, reassign and delete: the admin token this tab holds was refused (a new `blocks up` makes a new one): open the admin URL that `blocks up` printed."
        : "Scale, reassign and delete need the admin token: open the admin URL that `blocks up` printed (…/#token=…; the token is in the data dir's console/token)."));
  }
  put(root, 
    el("h2", {}, "Block ", el("span", { id: "block-id" }, b.id), " ", el("span", { id: "block-status" }, statusTag(b.status))),
    b.name ? el("p", {}, "name: ", el("span", { id: "block-name" }, b.name)) : null,
    el("p", { class: "muted" }, `cluster ${b.cluster || "-"} \u00b7 instances ${b.running ?? 0} running of ${b.desired ?? 0} wanted \u00b7 ${d.ir.blockComponentURI || ""}`),
    b.short ? el("p", { class: "short", id: "block-short" }, b.short) : null,
    d.desired_reason ? el("p", { class: "muted" }, "size: ", d.desired_reason) : null,
    ...acts,
    el("h3", {}, "Why (blocks explain)"), explainList(d.explain),
    el("h3", {}, "Instances"),
    d.instances.length ? table(["instance", "node", "GPUs", "status", "endpoint", ""], d.instances.map((i) => el("tr", { dataset: { instance: i.instance } },
      el("td", {}, i.instance), el("td", {}, i.node), el("td", {}, (i.gpus || []).join(", ")), el("td", {}, i.status), el("td", {}, i.endpoint || ""),
      el("td", {}, run ? el("button", { class: "reassign", on: { click: () => run("reassign", `/api/block/${encodeURIComponent(bid)}/reassign`, { instance: i.instance }) } }, "reassign") : null))), "instances") : el("p", { class: "muted", id: "instances" }, "none"),
    el("h3", {}, "Load (the metrics collector's window, live)"), sparks,
    el("h3", {}, `Story (${d.timeline.length} events)`),
    el("ol", { class: "timeline", id: "timeline" }, d.timeline.map((e) => el("li", { dataset: { seq: e.seq } },
      el("a", { href: `?seq=${e.seq}#/block/${encodeURIComponent(bid)}`, title: "the system at this event" }, `#${e.seq}`),
      el("span", { class: "muted" }, (e.time || "").slice(11, 23) || fmtTime(e.ts)), el("strong", {}, e.step, e.instance ? el("div", { class: "muted" }, e.instance) : null), el("span", { class: "line" }, e.line)))),
  );
}

// -- sparklines: the metrics collector's window of a block (inline SVG, no library) ---------------
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function sparkline(id, label, unit, points, width = 220, height = 40) {
  const vals = points.map((p) => p[1]).filter((v) => v !== null && v !== undefined);
  const last = vals.length ? vals[vals.length - 1] : null;
  const max = Math.max(1e-9, ...vals), t0 = points.length ? points[0][0] : 0, t1 = points.length ? points[points.length - 1][0] : 1;
  const xs = (t) => (t1 > t0 ? ((t - t0) / (t1 - t0)) * (width - 4) + 2 : width - 2);
  const ys = (v) => height - 2 - (v / max) * (height - 6);
  const line = points.filter((p) => p[1] !== null && p[1] !== undefined).map((p) => `${xs(p[0]).toFixed(1)},${ys(p[1]).toFixed(1)}`).join(" ");
  const chart = svg("svg", { id, class: "spark", width, height, viewBox: `0 0 ${width} ${height}`, "data-points": vals.length, "data-last": last ?? "" },
    svg("polyline", { points: line, fill: "none", stroke: "#2457c5", "stroke-width": 1.5 }));
  return el("div", { class: "spark-box" }, el("div", { class: "k" }, label), chart,
    el("div", { class: "n" }, last === null ? "-" : `${Number(last.toFixed(2))} ${unit}`), el("div", { class: "muted" }, `max ${Number(max.toFixed(2))}`));
}

async function drawSparks(box, bid) {
  const d = await api(`/api/block/${encodeURIComponent(bid)}/metrics`);
  const series = (key) => d.samples.map((s) => [s.t, s[key]]);
  put(box, d.samples.length
    ? [sparkline("spark-latency", "latency (dispatch p50)", "ms", series("latency_ms")), sparkline("spark-inflight", "in flight", "", series("inflight")),
      sparkline("spark-rate", "tasks/s", "/s", series("rate"))]
    : el("p", { class: "muted", id: "spark-none" }, d.why || "no sample yet (the metrics collector writes one per interval while the block has instances)"));
}

// -- a live trace replay: allocation vs arrived GPU requests, growing as it goes ---------------------
async function viewReplay(root) {
  const r = await api("/api/replay");
  const W = 560, H = 340, L = 44, B = 32, T = 10, R = 12;
  const xmax = Math.max(130, Math.ceil(r.arrived / 10) * 10), ymax = 100;
  const px = (x) => L + (x / xmax) * (W - L - R), py = (y) => H - B - (y / ymax) * (H - B - T);
  const parts = [];
  for (let x = 0; x <= xmax; x += 10) {
    parts.push(svg("line", { x1: px(x), x2: px(x), y1: py(0), y2: py(ymax), stroke: "#eef1f6" }), svg("text", { x: px(x), y: H - B + 14, "text-anchor": "middle", "font-size": 10, fill: "#6b7385" }, x));
  }
  for (let y = 0; y <= ymax; y += 20) {
    parts.push(svg("line", { x1: px(0), x2: px(xmax), y1: py(y), y2: py(y), stroke: "#eef1f6" }), svg("text", { x: L - 6, y: py(y) + 3, "text-anchor": "end", "font-size": 10, fill: "#6b7385" }, y));
  }
  parts.push(svg("line", { x1: px(0), y1: py(0), x2: px(100), y2: py(100), stroke: "#b9a6e3", "stroke-dasharray": "4 3" }),
    svg("text", { x: px(xmax / 2), y: H - 4, "text-anchor": "middle", "font-size": 11 }, "arrived GPU requests (% of the cluster's GPUs)"),
    svg("text", { x: 12, y: py(ymax / 2), "font-size": 11, transform: `rotate(-90 12 ${py(ymax / 2)})`, "text-anchor": "middle" }, "GPU allocation (%)"),
    svg("polyline", { id: "replay-line", points: r.curve.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" "), fill: "none", stroke: "#c0392b", "stroke-width": 2 }));
  const last = r.curve.length ? r.curve[r.curve.length - 1] : null;
  const chart = svg("svg", { id: "replay-chart", width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-points": r.curve.length, "data-last": last ? last[1] : "" }, ...parts);
  put(root,
    el("h2", {}, "Trace replay"),
    r.blocks
      ? el("p", { id: "replay-summary" }, `${r.policy || "?"} on the cluster ${r.cluster} (${r.gpus} GPUs): ${r.placed + r.failed} of ${r.blocks} tasks decided, ${r.placed} placed, ${r.failed} failed; allocation ${r.allocated.toFixed(2)} % at ${r.arrived.toFixed(1)} % arrived`)
      : el("p", { class: "muted", id: "replay-summary" }, "No live trace replay in this system: `blocks trace replay NODES PODS --live --data-dir DIR` against a fresh `blocks up` draws its curve here as it runs."),
    el("div", { class: "chart" }, chart),
    el("p", { class: "muted" }, "The curve of `blocks trace replay` (docs/trace.md), from the stream: each task's block in the order created, up to the first one not decided yet. Dashed: allocation = arrived."),
    r.curve.length ? table(["arrived %", "allocation %"], r.curve.slice(-10).reverse().map(([x, y]) => el("tr", {}, el("td", {}, x), el("td", {}, y.toFixed(2)))), "replay-table") : null,
  );
}

let tailFilter = "";
const TAIL_ROWS = 300;
function tailRow(e) { return el("div", { dataset: { subject: e.subject } }, `#${e.seq} ${fmtTime(e.ts)} ${e.subject}  ${e.line || ""}`); }
function subjectMatches(pattern, subject) {
  if (!pattern) return true;
  if (!pattern.includes("*") && !pattern.includes(">")) return subject.includes(pattern);
  const p = pattern.split("."), s = subject.split(".");
  for (let i = 0; i < p.length; i++) {
    if (p[i] === ">") return s.length > i;
    if (i >= s.length || (p[i] !== "*" && p[i] !== s[i])) return false;
  }
  return p.length === s.length;
}

async function viewEvents(root) {
  const d = await api(`/api/tail?limit=${TAIL_ROWS}&subject=` + encodeURIComponent(tailFilter));
  const input = el("input", { id: "tail-filter", placeholder: "subject filter: aios.block.*.ready, aios.node.>", value: tailFilter, size: 40 });
  input.addEventListener("change", () => { tailFilter = input.value.trim(); render(); });
  const box = el("div", { class: "tail", id: "tail" }, d.events.slice().reverse().map(tailRow));
  const none = d.events.length ? null : el("p", { class: "muted", id: "tail-empty" }, tailFilter ? "No stored event matches this filter (new ones appear here)." : "No event stored yet (new ones appear here).");
  put(root, el("h2", {}, "Live events"), el("div", { class: "toolbar" }, input, el("span", { class: "muted" }, "newest first; like `blocks watch`")), none, box);
}

// -- routing, live updates, the moment slider ---------------------------------------------------
function route() {
  const h = location.hash.replace(/^#/, "") || "/";
  const path = h.split("?")[0];
  if (path.startsWith("/block/")) return ["block", decodeURIComponent(path.slice(7))];
  if (path === "/map") return ["map"];
  if (path === "/blocks") return ["blocks"];
  if (path === "/events") return ["events"];
  if (path === "/replay") return ["replay"];
  return ["overview"];
}

let rendering = null, again = false;

// (the old fields themselves are held, and read once the new ones are drawn: what is typed while
// the view's data is fetched counts too)
function typed(root) {
  return { fields: [...root.querySelectorAll("input[id]")].filter((f) => f.type !== "range"), focus: document.activeElement };
}

function retype(kept) {
  for (const old of kept.fields) {
    const f = document.getElementById(old.id);
    if (!f || f === old || f.tagName !== "INPUT") continue;
    // (focused first, then given the text: leaving it or Enter then says change, as for the old one)
    if (kept.focus === old && document.activeElement !== f) f.focus();
    if (old.value !== old.defaultValue) f.value = old.value;
    if (kept.focus === old) {
      try { f.setSelectionRange(old.selectionStart, old.selectionEnd); } catch (e) { /* a number field has no selection */ }
    }
  }
}

async function render() {
  if (rendering) { again = true; return rendering; }
  const [view, arg] = route();
  state.view = view;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view || (view === "block" && a.dataset.view === "blocks"));
  const root = document.getElementById("view");
  // a live redraw of the same view keeps what is being typed: the focused field and any field
  // edited but not applied yet (a filter applies on Enter or when it loses focus)
  const kept = location.hash === state.drawn ? typed(root) : null;
  state.drawn = location.hash;
  rendering = (async () => {
    try {
      if (view === "map") await viewMap(root);
      else if (view === "blocks") await viewBlocks(root);
      else if (view === "block") await viewBlock(root, arg);
      else if (view === "events") await viewEvents(root);
      else if (view === "replay") await viewReplay(root);
      else await viewOverview(root);
      if (kept) retype(kept);
      root.dataset.rendered = String(Date.now());
    } catch (e) {
      put(root, el("p", { class: "reason" }, "could not load: ", e.message));
    }
  })();
  await rendering;
  rendering = null;
  if (again) { again = false; return render(); }
}

function scheduleRefresh(ev) {
  if (state.view === "events") {
    const box = document.getElementById("tail");
    if (box && subjectMatches(tailFilter, ev.subject)) {
      box.prepend(tailRow(ev));
      document.getElementById("tail-empty")?.remove();
      // (the newest TAIL_ROWS, as the first draw: a busy system's thousands of events a second
      // would otherwise grow the page without end)
      while (box.childElementCount > TAIL_ROWS) box.lastElementChild.remove();
    }
    return;
  }
  if (state.view === "block") {
    const [, bid] = route();
    if (!ev.subject.startsWith(`aios.block.${bid}.`)) return;
  }
  if (state.view === "replay" && !ev.subject.startsWith("aios.block.")) return;
  const delay = state.view === "map" ? 1000 : state.view === "replay" ? 300 : 150;
  if (state.refresh) return;
  state.refresh = setTimeout(() => { state.refresh = null; render(); }, delay);
}

function setupMoment() {
  const slider = document.getElementById("seq-slider"), label = document.getElementById("seq-label"), live = document.getElementById("seq-live");
  slider.max = String(Math.max(1, state.lastSeq));
  slider.value = PAST === null ? slider.max : PAST;
  label.textContent = PAST === null ? "live" : `seq ${PAST}`;
  slider.addEventListener("input", () => { label.textContent = `seq ${slider.value}`; });
  slider.addEventListener("change", () => { location.search = "?seq=" + slider.value; });
  live.addEventListener("click", () => { location.href = location.pathname + location.hash; });
  if (PAST !== null) {
    const banner = document.getElementById("past-banner");
    banner.hidden = false;
    // (a sequence after the last stored event folds the whole stream: the system now, not 'as it was')
    banner.textContent = !/^\d+$/.test(PAST) ? `?seq=${PAST} is no stream sequence number: use the slider, or the live button.`
      : state.seqKnown && Number(PAST) > state.lastSeq  // (0 too: an empty stream was 'as it was at N')
        ? `Sequence ${PAST} is after the last stored event (${state.lastSeq}): this is the system as it is now, folded from the stream. Live updates are off.`
        : `The system as it was at stream sequence ${PAST} (the stream folded up to it). Live updates are off.`;
  }
}

async function start() {
  try {
    const who = await fetch("/api/whoami", { headers: token() ? { "X-Console-Token": token() } : {} }).then((r) => r.json());
    state.admin = who.admin; state.actions = who.actions; state.lastSeq = who.seq; state.seqKnown = true;
  } catch (e) { /* the view says what failed */ }
  const role = document.getElementById("role");
  role.textContent = state.admin ? "admin" : token() ? "observer (admin token refused)" : "observer (read only)";
  role.classList.toggle("admin", state.admin);
  role.id = "role";
  setupMoment();
  window.addEventListener("hashchange", render);
  await render();
  if (PAST === null) {
    const es = new EventSource("/api/events");
    // (a console restarted by `blocks up` comes back on the same URL: the browser reconnects, and
    // the view is drawn again for what was stored meanwhile)
    let hellos = 0;
    // (while it is away, the page says so: it showed the last view as if live, with no sign that
    // `blocks up` had stopped or was restarting)
    const lost = document.getElementById("live-banner");
    es.addEventListener("hello", () => { lost.hidden = true; if (hellos++ > 0) render(); });
    es.onerror = () => {
      lost.hidden = false;
      lost.textContent = "The console's server does not answer (`blocks up` stopped, or restarting): this view is as it was; it reconnects by itself and redraws.";
    };
    es.onmessage = (m) => {
      const ev = JSON.parse(m.data);
      state.lastSeq = Math.max(state.lastSeq, ev.seq);
      document.getElementById("seq-slider").max = String(state.lastSeq);
      if (PAST === null) document.getElementById("seq-slider").value = String(state.lastSeq);
      scheduleRefresh(ev);
    };
  }
}

start();
