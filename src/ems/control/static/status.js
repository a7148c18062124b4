// The ems status page: GET /v1/hosts every 2 s (admin token from #token=... or the
// form, kept in sessionStorage: never sent anywhere but this service), then tables.
"use strict";
const STALE_S = 15;
const $ = (sel) => document.querySelector(sel);

function token() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem("ems-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("ems-token") || "";
}

function size(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}
// The cluster tier's counters, where a daemon reports one (tiers.cluster); else null.
const clusterOf = (t) => (t.tiers && t.tiers.cluster) || null;
// A hit rate as a percentage, "-" before the first lookup. A row's own rate is the
// hit_rate it carries on the wire; sumRate is the rate of a sum of rows (hosts, tenants).
const pct = (rate, lookups) => (lookups ? (100 * rate).toFixed(1) + "%" : "-");
const rowRate = (row) => pct(row.hit_rate, row.hits + row.misses);
const sumRate = (hits, misses) => pct(hits / (hits + misses || 1), hits + misses);

function cell(text, attrs) {
  const td = document.createElement("td");
  td.textContent = text;
  for (const [k, v] of Object.entries(attrs || {})) td.setAttribute(k, v);
  return td;
}

function fill(table, rows) {
  const body = $(table + " tbody");
  body.replaceChildren(...rows.map(([cells, cls]) => {
    const tr = document.createElement("tr");
    if (cls) tr.className = cls;
    tr.append(...cells);
    return tr;
  }));
}

function card(label, value, id) {
  const div = document.createElement("div");
  div.className = "card";
  div.innerHTML = `<div class="v" id="${id}"></div><div class="k"></div>`;
  div.querySelector(".v").textContent = value;
  div.querySelector(".k").textContent = label;
  return div;
}

function render(data) {
  const tenants = new Map(data.tenants.map((t) => [t.access_id, {
    quota: t.quota_bytes, keys: t.active_keys, hosts: 0, capacity: 0, used: 0,
    objects: 0, hits: 0, misses: 0, ctier: false, chits: 0, cmisses: 0 }]));
  let cap = 0, used = 0, hits = 0, misses = 0, live = 0, chits = 0, cmisses = 0, ctier = false;
  const hostRows = [], cellRows = [];
  for (const h of data.hosts) {
    const r = h.report, srv = r.server || {};
    const stale = h.age_s > STALE_S;
    if (!stale) live++;
    let hc = 0, hu = 0, ho = 0, hh = 0, hm = 0, hch = 0, hcm = 0, hct = false;
    for (const [name, t] of Object.entries(r.tenants || {})) {
      hc += t.capacity_bytes; hu += t.used_bytes; ho += t.objects; hh += t.hits; hm += t.misses;
      const c = clusterOf(t);
      if (c) { hct = true; hch += c.hits; hcm += c.misses; }
      const agg = tenants.get(name);
      if (agg) {
        agg.hosts++; agg.capacity += t.capacity_bytes; agg.used += t.used_bytes;
        agg.objects += t.objects; agg.hits += t.hits; agg.misses += t.misses;
        if (c) { agg.ctier = true; agg.chits += c.hits; agg.cmisses += c.misses; }
      }
      const at = { "data-host": h.host, "data-tenant": name };
      cellRows.push([[cell(h.host, { class: "name" }), cell(name, { class: "name" }),
        cell(size(t.capacity_bytes), { ...at, "data-field": "capacity" }),
        cell(size(t.used_bytes), { ...at, "data-field": "used" }),
        cell(String(t.objects), { ...at, "data-field": "objects" }),
        cell(String(t.connections), { ...at, "data-field": "connections" }),
        cell(String(t.hits), { ...at, "data-field": "hits" }),
        cell(`${t.misses} (${t.miss_absent || 0} / ${t.miss_size_mismatch || 0} / ${t.miss_pending || 0})`,
             { ...at, "data-field": "misses" }),
        cell(rowRate(t), { ...at, "data-field": "hit-rate-local" }),
        cell(String(t.evictions), { ...at, "data-field": "evictions" })], stale ? "stale" : ""]);
    }
    cap += hc; used += hu; hits += hh; misses += hm;
    if (hct) { ctier = true; chits += hch; cmisses += hcm; }
    const at = { "data-host": h.host };
    const ctl = r.control || {};
    hostRows.push([[cell(h.host, { class: "name" }),
      cell(stale ? "stale" : "up", { ...at, "data-field": "state" }),
      cell(String(srv.pid ?? "-")),
      cell(String(srv.connections ?? "-"), { ...at, "data-field": "connections" }),
      cell(size(hc), { ...at, "data-field": "capacity" }),
      cell(size(hu), { ...at, "data-field": "used" }),
      cell(String(ho), { ...at, "data-field": "objects" }),
      cell(sumRate(hh, hm), { ...at, "data-field": "hit-rate-local" }),
      cell(hct ? sumRate(hch, hcm) : "-", { ...at, "data-field": "hit-rate-cluster" }),
      cell(String(ctl.revision ?? "-"), { ...at, "data-field": "revision" }),
      cell(`${h.age_s.toFixed(1)} s ago`)], stale ? "stale" : ""]);
  }
  fill("#hosts", hostRows);
  fill("#cells", cellRows);
  fill("#tenants", [...tenants.entries()].map(([name, t]) => {
    const at = { "data-tenant": name };
    return [[cell(name, { class: "name" }), cell(size(t.quota), { ...at, "data-field": "quota" }),
      cell(String(t.keys), { ...at, "data-field": "keys" }),
      cell(String(t.hosts), { ...at, "data-field": "hosts" }),
      cell(size(t.capacity), { ...at, "data-field": "capacity" }),
      cell(size(t.used), { ...at, "data-field": "used" }),
      cell(String(t.objects), { ...at, "data-field": "objects" }),
      cell(String(t.hits), { ...at, "data-field": "hits" }),
      cell(String(t.misses), { ...at, "data-field": "misses" }),
      cell(sumRate(t.hits, t.misses), { ...at, "data-field": "hit-rate-local" }),
      cell(t.ctier ? sumRate(t.chits, t.cmisses) : "-", { ...at, "data-field": "hit-rate-cluster" })]];
  }));
  $("#summary").replaceChildren(
    card("hosts up", `${live} / ${data.hosts.length}`, "sum-hosts"),
    card("tenants", String(data.tenants.length), "sum-tenants"),
    card("capacity", size(cap), "sum-capacity"),
    card("used", size(used), "sum-used"),
    card("hit rate local", sumRate(hits, misses), "sum-hit-rate-local"),
    card("hit rate cluster", ctier ? sumRate(chits, cmisses) : "-", "sum-hit-rate-cluster"));
  $("#revision").textContent = String(data.revision);
  $("#updated").textContent = new Date().toLocaleTimeString();
}

let refused = false;  // the last token was refused: say so until another is given

async function refresh() {
  const tok = token();
  if (!tok) {
    $("#login").hidden = false;
    if (!refused) setState("error", "admin token needed");
    return;
  }
  try {
    const resp = await fetch("/v1/hosts", { headers: { Authorization: "Bearer " + tok } });
    if (resp.status === 401) {
      sessionStorage.removeItem("ems-token");
      refused = true;
      $("#login").hidden = false;
      setState("error", "token refused");
      return;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
    refused = false;
    $("#login").hidden = true;
    setState("ok", "live");
  } catch (err) {
    setState("error", "control plane unreachable: " + err.message);
  }
}

function setState(state, text) {
  const el = $("#state");
  el.dataset.state = state;
  el.textContent = text;
}

$("#login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("ems-token", $("#token").value.trim());
  refresh();
});
refresh();
setInterval(refresh, 2000);
