"""The status page itself: one HTML document with its style and script inline (allowed by their
hashes in the page's Content-Security-Policy), loading nothing from anywhere. Its script polls
/admin/status every second and draws it with DOM calls only (data never becomes markup)."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>search-proxy status</title>
<style>{style}</style>
</head>
<body>
<header>
  <h1>search-proxy</h1>
  <div id="summary"></div>
  <div id="freshness" class="chip idle">connecting…</div>
</header>
<form id="login" hidden>
  <label>Admin token <input id="token" type="password" autocomplete="off"></label>
  <button type="submit">Show status</button>
  <span id="login-why"></span>
</form>
<main>
  <h2 class="section">Routes</h2>
  <div id="routes" class="grid"></div>
  <h2 class="section">/v1/search and MCP</h2>
  <div id="endpoints" class="grid"></div>
  <table id="providers"></table>
  <h2 class="section">Last errors</h2>
  <table id="errors"></table>
</main>
<script>{script}</script>
</body>
</html>
"""

STYLE = """
:root { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2933;
  background: #f4f5f7; }
body { margin: 0; }
header { display: flex; flex-wrap: wrap; align-items: center; gap: 12px; padding: 10px 18px;
  background: #1f2933; color: #f4f5f7; }
h1 { font-size: 18px; margin: 0 12px 0 0; }
#summary { display: flex; flex-wrap: wrap; gap: 8px; flex: 1; }
main { padding: 6px 18px 24px; }
h2.section { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: #52606d;
  margin: 18px 0 8px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr)); gap: 12px; }
.card { background: #fff; border-radius: 6px; padding: 10px 12px; border-left: 6px solid #9aa5b1;
  box-shadow: 0 1px 2px rgba(0,0,0,.08); }
.card.ok { border-left-color: #2f9e44; }
.card.warn { border-left-color: #f08c00; }
.card.bad { border-left-color: #e03131; background: #fff5f5; }
.card.idle { border-left-color: #9aa5b1; }
.card h3 { margin: 0; font-size: 15px; display: flex; gap: 8px; align-items: baseline; }
.card h3 .sub { font-weight: normal; color: #7b8794; font-size: 12px; overflow: hidden;
  text-overflow: ellipsis; white-space: nowrap; }
.numbers { display: grid; grid-template-columns: repeat(5, 1fr); gap: 4px; margin: 8px 0 4px; }
.numbers div { text-align: center; }
.numbers b { display: block; font-size: 15px; white-space: nowrap; }
.numbers span { color: #7b8794; font-size: 11px; }
.sparks { display: flex; gap: 10px; align-items: center; color: #7b8794; font-size: 11px; }
.spark { background: #f8f9fa; border-radius: 3px; }
.spark polyline { fill: none; stroke-width: 1.5; }
.spark.rate polyline { stroke: #1c7ed6; }
.spark.errors polyline { stroke: #e03131; }
.facts { display: flex; flex-wrap: wrap; gap: 6px; margin-top: 6px; }
.chip { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  background: #e4e7eb; color: #1f2933; white-space: nowrap; }
.chip.ok { background: #d3f9d8; color: #2b8a3e; }
.chip.warn { background: #ffe8cc; color: #d9480f; }
.chip.bad { background: #ffe3e3; color: #c92a2a; font-weight: 600; }
.chip.idle { background: #e4e7eb; color: #52606d; }
header .chip { background: #323f4b; color: #e4e7eb; }
header .chip.ok { background: #2b8a3e; color: #fff; }
header .chip.warn { background: #d9480f; color: #fff; }
header .chip.bad { background: #c92a2a; color: #fff; }
ul.errs { margin: 6px 0 0; padding-left: 16px; color: #c92a2a; font-size: 12px; }
table { border-collapse: collapse; background: #fff; margin-top: 10px; width: 100%;
  font-size: 12px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e4e7eb;
  vertical-align: top; }
th { color: #52606d; font-weight: 600; }
form#login { margin: 12px 18px; display: flex; gap: 8px; align-items: center; }
form#login[hidden] { display: none; }
"""

SCRIPT = r"""
"use strict";
const KEY = "search-proxy-admin-token";
const SVG = "http://www.w3.org/2000/svg";
const byId = (id) => document.getElementById(id);
let token = sessionStorage.getItem(KEY) || "";

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function chip(text, cls, data) {
  const node = el("span", "chip " + (cls || ""), text);
  for (const [k, v] of Object.entries(data || {})) node.dataset[k] = v;
  return node;
}
const show = (v, unit) => (v === null || v === undefined ? "–" : v + (unit || ""));
const ms = (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) + " ms"
  : v < 1000 ? Math.round(v) + " ms" : (v / 1000).toFixed(1) + " s");
const rate = (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) : Math.round(v));
const secs = (s) => (s >= 90 ? Math.round(s / 60) + " min" : Math.round(s) + " s");

function spark(values, kind, label) {
  const w = 120, h = 26, svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 " + w + " " + h);
  svg.setAttribute("width", w); svg.setAttribute("height", h);
  svg.setAttribute("class", "spark " + kind);
  const max = Math.max(0.000001, ...values), n = values.length;
  const points = values.map((v, i) =>
    (n > 1 ? (i * w) / (n - 1) : 0).toFixed(1) + "," + (h - 2 - (v / max) * (h - 4)).toFixed(1));
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.join(" "));
  const title = document.createElementNS(SVG, "title");
  title.textContent = label + ", last minute (peak " + max.toFixed(2) + "/s)";
  svg.append(title, line);
  return svg;
}

function numbers(item) {
  const box = el("div", "numbers");
  const cells = [
    ["req/s", rate(item.requests_per_s)], ["ok", show(item.success_pct, "%")],
    ["p50", ms(item.p50_ms)], ["p99", ms(item.p99_ms)],
    ["in flight", item.in_flight],
  ];
  for (const [label, value] of cells) {
    const cell = el("div");
    cell.append(el("b", null, value), el("span", null, label));
    box.append(cell);
  }
  return box;
}

function sparks(item) {
  const box = el("div", "sparks");
  box.append(el("span", null, "rate"), spark(item.rate || [], "rate", "requests/s"),
    el("span", null, "errors"), spark(item.errors || [], "errors", "errors/s"));
  return box;
}

function errorsList(list) {
  const ul = el("ul", "errs");
  for (const e of (list || []).slice(0, 3)) {
    const what = e.at.slice(11, 19) + " " + e.status + " " + (e.error || "vendor");
    ul.append(el("li", null, what + ": " + e.message));
  }
  return ul;
}

function counts(name, values) {
  const parts = Object.entries(values || {}).map(([k, v]) => k + " " + Math.round(v));
  return chip(name + ": " + (parts.join(", ") || "none"));
}

function routeCard(r) {
  const card = el("section", "card " + r.colour);
  card.dataset.route = r.name;
  const head = el("h3", null, r.name);
  head.append(el("span", "sub", r.prefix + " → " + r.upstream));
  const facts = el("div", "facts");
  if (r.breaker) {
    const b = r.breaker, cls = { closed: "ok", half_open: "warn", open: "bad" }[b.state];
    let text = "breaker " + b.state.replace("_", "-") + " " + secs(b.for_s);
    if (b.state === "open") text += ", retry in " + secs(b.retry_in_s);
    facts.append(chip(text, cls, { breaker: b.state }));
  }
  if (r.limiter) {
    const l = r.limiter;
    let text = "limit " + l.rate + " burst " + l.burst;
    if (l.tokens !== null) text += ", " + l.tokens + " tokens, " + l.queued + " queued";
    if (l.per_client) text += ", per client";
    facts.append(chip(text, l.queued > 0 ? "warn" : ""));
  }
  if (r.cache) facts.append(chip("cache " + show(r.cache.hit_pct, "% hits") +
    (r.cache.entries === null ? "" : ", " + r.cache.entries + " entries")));
  if (r.hedges) facts.append(counts("hedges", r.hedges));
  if (r.failovers) facts.append(counts("failovers", r.failovers));
  if (r.missing_key) facts.append(chip("no key: " + r.missing_key + " empty", "warn"));
  card.append(head, numbers(r), sparks(r), facts, errorsList(r.last_errors));
  return card;
}

function endpointCard(e) {
  const card = el("section", "card " + (!e.enabled ? "idle" : e.requests_per_s ? "ok" : "idle"));
  card.dataset.endpoint = e.name;
  const head = el("h3", null, e.name);
  head.append(el("span", "sub", e.enabled ? "" : "off"));
  card.append(head, numbers(e), sparks(e), errorsList(e.last_errors));
  return card;
}

function table(node, columns, rows) {
  const head = el("tr");
  for (const c of columns) head.append(el("th", null, c));
  node.replaceChildren(head);
  for (const row of rows) {
    const tr = el("tr");
    for (const cell of row) tr.append(cell instanceof Node ? wrap(cell) : el("td", null, cell));
    node.append(tr);
  }
}
function wrap(node) { const td = el("td"); td.append(node); return td; }

function draw(s) {
  const summary = byId("summary");
  const redis = { up: "ok", down: "bad", "not configured": "idle" }[s.redis];
  const reload = s.config.last_reload;
  summary.replaceChildren(
    chip("version " + s.version), chip("config " + (s.config.hash || "–")),
    chip("watch " + (s.config.watch ? "on" : "off")),
    chip("Redis " + s.redis, redis, { redis: s.redis }), chip("up " + secs(s.uptime_s)));
  if (s.worker) summary.append(chip("worker " + s.worker.index + " of " + s.worker.workers
    + ": its own numbers; /metrics adds up all", "idle", { worker: s.worker.index }));
  if (reload) summary.append(chip("last reload " + reload.result + " (" + reload.trigger + ")",
    reload.result === "failed" ? "bad" : "ok", { reload: reload.result }));
  byId("routes").replaceChildren(...s.routes.map(routeCard));
  byId("endpoints").replaceChildren(...s.endpoints.map(endpointCard));
  table(byId("providers"), ["provider", "state", "why"], s.providers.map((p) => [
    p.name, chip(p.state, p.state === "ready" ? "ok" : "warn", { provider: p.state }), p.why || "",
  ]));
  const errors = s.errors.map((e) => [e.at, e.route, e.status, e.error || "(vendor)", e.message]);
  if (!errors.length) errors.push(["none since start", "", "", "", ""]);
  table(byId("errors"), ["time", "route", "status", "error", "message"], errors);
}

function fresh(text, cls) {
  const node = byId("freshness");
  node.className = "chip " + cls;
  node.textContent = text;
}

async function poll() {
  try {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const r = await fetch("/admin/status", { headers, cache: "no-store" });
    if (r.status === 401) {
      byId("login").hidden = false;
      byId("login-why").textContent = token ? "that token was refused" : "";
      fresh("admin token needed", "warn");
    } else if (!r.ok) {
      fresh("status answered " + r.status, "bad");
    } else {
      byId("login").hidden = true;
      draw(await r.json());
      fresh("updated " + new Date().toLocaleTimeString(), "ok");
    }
  } catch (err) {
    fresh("cannot reach the proxy", "bad");
  }
  setTimeout(poll, 1000);
}

byId("login").addEventListener("submit", (event) => {
  event.preventDefault();
  token = byId("token").value.trim();
  sessionStorage.setItem(KEY, token);
});
poll();
"""
