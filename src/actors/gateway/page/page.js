// The live fleet page. Reads one SSE stream, /v1/fleet/live: `view` frames (the published
// fleet view, slimmed, with rates) and `fleet` events (the gateway's bus, with faults and role
// changes relayed from every node). No framework, no external assets. The chaos form and
// buttons call the chaos API (/chaos/faults) and show only when it is on.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const HISTORY = 150;       // points kept per chart (a frame every 0.5–2 s: 2–5 minutes)
  const HEAT_MS = 30000;     // placements counted per worker over this window
  const MAX_ROWS = 15;       // rows kept in the decisions and transfers tables
  const MAX_EVENTS = 200;    // lines kept in the event log
  const state = {
    view: null,
    series: [],               // {t, req, tok, ttft50, ttft99, itl50, itl99, mig, rst, pan, shed}
    last: null,               // the previous frame's totals (for per-interval counts)
    placements: [],           // {t, worker}
    handoffs: new Map(),      // request -> {from, tokens}
    faults: new Map(),        // id -> record
    chaosLoaded: false,
  };

  // The client's x-request-id (what the logs carry) when it sent one, else the gateway's id.
  const rid = (e) => e.request_id || e.request;
  const fmt = (v, d = 0) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);
  const time = (ms) => new Date(ms).toLocaleTimeString();
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("data-") || k.startsWith("aria-") || k === "title" || k === "role") e.setAttribute(k, v);
      else e[k] = v;
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }
  function fill(tbody, rows) {
    tbody.replaceChildren(...rows);
  }

  // ---- view frames ----
  function workersOf(view) {
    const out = [];
    for (const n of view.nodes) for (const w of n.workers || []) out.push({ node: n, w });
    return out;
  }
  function onView(view) {
    state.view = view;
    $("gateway-node").textContent = view.gateway.node + (view.gateway.draining ? " (draining)" : "");
    const nodes = view.nodes;
    const all = workersOf(view);
    const ready = all.filter(({ node, w }) => node.state === "up" && w.health === "ready").length;
    $("nodes-up").textContent = nodes.filter((n) => n.state === "up").length;
    $("nodes-total").textContent = nodes.length;
    $("workers-ready").textContent = ready;
    $("workers-total").textContent = all.length;
    const r = view.rates || {};
    $("req-rate").textContent = fmt(r.request_rate, 1);
    const tokRate = r.generated_token_rate != null ? r.generated_token_rate : r.output_token_rate;
    $("tok-rate").textContent = fmt(tokRate, 0);
    // Latency percentiles come from the requests that finished in the window: a quiet window
    // keeps the last ones measured (marked as such) rather than a blank.
    if (r.ttft_p99_ms != null) state.lastLatency = { r, at: view.at_ms };
    const lat = state.lastLatency ? state.lastLatency.r : r;
    const stale = state.lastLatency && r.ttft_p99_ms == null ? " *" : "";
    $("ttft").textContent = fmt(lat.ttft_p50_ms) + " / " + fmt(lat.ttft_p99_ms) + stale;
    $("itl").textContent = fmt(lat.itl_p50_ms, 1) + " / " + fmt(lat.itl_p99_ms, 1) + stale;
    $("ttft").title = $("itl").title = stale ? "no request finished in the last window: the last measured, at " + time(state.lastLatency.at) : "";
    const inFlight = all.filter(({ node }) => node.state === "up").reduce((s, { w }) => s + (w.in_flight || 0), 0);
    $("in-flight").textContent = inFlight;
    $("waiting").textContent = all.filter(({ node }) => node.state === "up").reduce((s, { w }) => s + (w.waiting || 0), 0);
    $("kv-use").textContent = fmt(100 * (r.kv_usage || 0), 0) + " %";
    const t = view.totals;
    $("migrations").textContent = t.migrations;
    // Actor restarts (supervisors) and node restarts (`flotilla up` starting a node again): a
    // restarted node's own actor count starts from zero, its restart is counted by the launcher.
    const restarts = (x) => (x.restarts || 0) + (x.node_restarts || 0);
    $("restarts").textContent = restarts(t);
    $("restarts").title = (t.restarts || 0) + " actor restarts, " + (t.node_restarts || 0) + " node restarts";
    $("panics").textContent = t.panics;
    $("shed").textContent = t.shed;
    const prev = state.last || t;
    state.series.push({
      t: view.at_ms, req: r.request_rate || 0, tok: tokRate || 0,
      ttft50: r.ttft_p50_ms, ttft99: r.ttft_p99_ms, itl50: r.itl_p50_ms, itl99: r.itl_p99_ms,
      mig: Math.max(0, t.migrations - prev.migrations), rst: Math.max(0, restarts(t) - restarts(prev)),
      pan: Math.max(0, t.panics - prev.panics), shed: Math.max(0, t.shed - prev.shed),
    });
    state.last = t;
    if (state.series.length > HISTORY) state.series.shift();
    renderNodes(nodes);
    renderWorkers(all);
    renderPlanner(nodes);
    renderCharts();
    renderChaos(view, all);
  }

  function renderNodes(nodes) {
    fill($("nodes").tBodies[0], nodes.map((n) => {
      const c = n.counters || {};
      return el("tr", { "data-node": n.id, "data-state": n.state },
        el("th", { scope: "row" }, n.id),
        el("td", { class: "state-" + n.state }, n.state),
        el("td", {}, (n.roles || []).join(", ")),
        el("td", {}, n.pid),
        el("td", {}, (n.workers || []).length),
        el("td", {}, c.migrations || 0), el("td", {}, c.restarts || 0), el("td", {}, c.panics || 0),
        el("td", {}, c.engine_hangs || 0), el("td", {}, c.node_restarts || 0));
    }));
  }

  function heatCounts() {
    const cut = Date.now() - HEAT_MS;
    while (state.placements.length && state.placements[0].t < cut) state.placements.shift();
    const m = new Map();
    for (const p of state.placements) m.set(p.worker, (m.get(p.worker) || 0) + 1);
    return m;
  }

  function renderWorkers(all) {
    const heat = heatCounts();
    const max = Math.max(1, ...heat.values());
    fill($("workers").tBodies[0], all.map(({ node, w }) => {
      const health = node.state === "up" ? (w.health || "unknown") : "unreachable";
      const used = w.kv_blocks_used || 0, total = w.kv_blocks_total || 0;
      const pct = total ? (100 * used / total) : 0;
      const tiers = w.kv_tiers ? (w.kv_tiers.host_blocks + " / " + w.kv_tiers.disk_blocks) : "–";
      const hit = w.prompt_tokens ? fmt(100 * w.cached_tokens / w.prompt_tokens, 0) + " %" : "–";
      const pulled = (w.kv_blocks_pulled || 0) + ((w.kv_peer_pulls && w.kv_peer_pulls.blocks) || 0);
      return el("tr", { "data-worker": w.id, "data-health": health, "data-running": w.running || 0, "data-waiting": w.waiting || 0 },
        el("th", { scope: "row" }, w.id),
        el("td", { class: "health-" + health }, health),
        el("td", {}, w.role || "–"),
        el("td", {}, w.running || 0),
        el("td", {}, w.waiting || 0),
        el("td", { title: used + " of " + total + " blocks" },
          el("span", { class: "bar", "aria-hidden": "true" }, el("span", {})), fmt(pct, 0) + " %"),
        el("td", {}, tiers),
        el("td", {}, hit),
        el("td", {}, heat.get(w.id) || 0),
        el("td", {}, pulled));
    }));
    // bar widths (set after creation: `style` as a property needs an object)
    const rows = $("workers").tBodies[0].rows;
    all.forEach(({ w }, i) => {
      const total = w.kv_blocks_total || 0;
      const inner = rows[i].querySelector(".bar > span");
      if (inner) inner.style.width = (total ? 100 * (w.kv_blocks_used || 0) / total : 0) + "%";
    });
    fill($("heat"), all.map(({ node, w }) => {
      const n = heat.get(w.id) || 0;
      const a = n / max;
      const d = el("div", { role: "listitem", title: w.id + ": " + n + " placements in 30 s", "aria-label": w.id + ": " + n + " placements" }, n || "");
      d.style.background = n ? "rgba(9,105,218," + (0.15 + 0.85 * a).toFixed(2) + ")" : "";
      if (node.state !== "up" || w.health !== "ready") d.className = "down";
      return d;
    }));
  }

  function renderPlanner(nodes) {
    const p = nodes.map((n) => n.planner).find((p) => p && p.decisions && p.decisions.length);
    $("planner-section").hidden = !p;
    if (!p) return;
    const d = p.decisions[p.decisions.length - 1];
    fill($("planner").tBodies[0], (d.pools || []).map((pool) =>
      el("tr", { "data-pool": pool.role },
        el("th", { scope: "row" }, pool.role),
        el("td", {}, pool.actual), el("td", {}, pool.desired), el("td", {}, pool.reason || ""))));
  }

  // ---- charts (canvas sparklines) ----
  const COLORS = ["#0969da", "#cf222e", "#8250df", "#9a6700"];
  function chart(id, keys) {
    const c = $(id);
    const ctx = c.getContext("2d");
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 320, h = c.clientHeight || 90;
    if (c.width !== Math.round(w * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const pts = state.series;
    let max = 0;
    for (const p of pts) for (const k of keys) if (p[k] != null) max = Math.max(max, p[k]);
    max = max || 1;
    ctx.fillStyle = "#5b6570";
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillText(fmt(max, max < 10 ? 1 : 0), 2, 10);
    keys.forEach((k, i) => {
      ctx.strokeStyle = COLORS[i];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      pts.forEach((p, j) => {
        if (p[k] == null) { started = false; return; }
        const x = pts.length < 2 ? w : (j / (HISTORY - 1)) * w;
        const y = h - 2 - (p[k] / max) * (h - 14);
        if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
      });
      ctx.stroke();
    });
  }
  function renderCharts() {
    chart("chart-req", ["req"]);
    chart("chart-tok", ["tok"]);
    chart("chart-ttft", ["ttft50", "ttft99"]);
    chart("chart-itl", ["itl50", "itl99"]);
    chart("chart-faults", ["mig", "rst", "pan", "shed"]);
  }

  // ---- fleet events ----
  function describe(e) {
    switch (e.event) {
      case "placed": return "request " + rid(e) + " placed on " + e.worker + (e.attempt > 1 ? " (attempt " + e.attempt + ")" : "") + (e.hand_off ? " for prefill" : "");
      case "handed_off": return "request " + rid(e) + ": " + e.from + " handed off " + e.tokens + " prompt tokens of KV";
      case "migrated": return "request " + rid(e) + " migrated from " + (e.from || "?") + " with " + e.generated + " tokens: " + e.reason;
      case "gave_up": return "request " + rid(e) + " given up: " + e.reason;
      case "fault_installed": return "fault " + e.id + " (" + e.kind + ") installed on " + e.node + ": " + (e.workers || []).join(", ");
      case "fault_cleared": return "fault " + e.id + " cleared on " + e.node + (e.expired ? " (expired)" : "");
      case "role_changed": return e.worker + " is now " + e.role;
      case "worker_up": return e.worker + " up";
      case "worker_down": return e.worker + " down";
      case "node_up": case "node_suspect": case "node_down": return "node " + e.node + " " + e.event.slice(5);
      case "lagged": return "the page fell behind: " + e.missed + " events missed";
      default: return JSON.stringify(e);
    }
  }
  const BAD = new Set(["gave_up", "worker_down", "node_down", "fault_installed"]);
  const WARN = new Set(["migrated", "node_suspect", "lagged"]);
  function logEvent(e) {
    const list = $("events");
    const li = el("li", { class: BAD.has(e.event) ? "bad" : WARN.has(e.event) ? "warn" : "", "data-event": e.event },
      time(e.at_ms || Date.now()) + "  " + describe(e));
    list.prepend(li);
    while (list.children.length > MAX_EVENTS) list.lastChild.remove();
  }
  function addRow(table, row) {
    const tb = $(table).tBodies[0];
    tb.prepend(row);
    while (tb.rows.length > MAX_ROWS) tb.lastChild.remove();
  }
  function onFleet(e) {
    if (e.event === "placed") {
      state.placements.push({ t: e.at_ms || Date.now(), worker: e.worker });
      const t = e.terms;
      addRow("decisions", el("tr", { "data-request": e.request },
        el("td", {}, time(e.at_ms)), el("td", { class: "rid", title: "gateway id " + e.request }, rid(e)), el("th", { scope: "row" }, e.worker),
        el("td", {}, e.attempt + (e.hand_off ? " ⇢" : "")),
        el("td", {}, t ? t.overlap_blocks + " / " + t.best_overlap_blocks : "–"),
        el("td", {}, t ? fmt(t.credited_blocks, 1) : "–"),
        el("td", {}, t ? fmt(t.prefill_blocks, 1) : "–"),
        el("td", {}, t ? fmt(t.decode_blocks, 1) : "–"),
        el("td", {}, t ? fmt(t.cost, 1) : "pinned")));
      const h = state.handoffs.get(e.request);
      if (h && !e.hand_off) {
        state.handoffs.delete(e.request);
        addRow("transfers", el("tr", {}, el("td", {}, time(e.at_ms)), el("td", { class: "rid" }, rid(e)),
          el("td", {}, h.from), el("td", {}, e.worker), el("td", {}, h.tokens + " prompt tokens (hand-off)")));
      }
      if (t && t.pull_from) {
        addRow("transfers", el("tr", {}, el("td", {}, time(e.at_ms)), el("td", { class: "rid" }, rid(e)),
          el("td", {}, t.pull_from), el("td", {}, e.worker), el("td", {}, (t.pull_blocks || 0) + " blocks (peer pull)")));
      }
      return; // placements are too many for the log
    }
    if (e.event === "handed_off") {
      state.handoffs.set(e.request, { from: e.from, tokens: e.tokens });
      // the decode attempt's `placed` names the client's id; the hand-off only the gateway's
      if (state.handoffs.size > 1000) state.handoffs.delete(state.handoffs.keys().next().value);
    }
    if (e.event === "fault_installed" || e.event === "fault_cleared") faultsSoon();
    logEvent(e);
  }

  // ---- chaos ----
  function chaosHeaders(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const tok = $("chaos-token").value;
    if (tok) h["Authorization"] = "Bearer " + tok;
    return h;
  }
  function canCallChaos() {
    const v = state.view;
    return v && v.chaos.enabled && (!v.chaos.token || $("chaos-token").value);
  }
  // One listing for a burst of fault events (the history replayed on connect has many).
  let faultsTimer = null;
  function faultsSoon() {
    if (faultsTimer === null) faultsTimer = setTimeout(() => { faultsTimer = null; loadFaults(); }, 200);
  }
  async function loadFaults() {
    if (!canCallChaos()) return;
    try {
      const res = await fetch("/chaos/faults", { headers: chaosHeaders(false) });
      if (!res.ok) { $("chaos-msg").textContent = "listing faults: HTTP " + res.status; return; }
      const body = await res.json();
      const list = Array.isArray(body) ? body : (body.faults || []);
      state.faults = new Map(list.filter((f) => f.active).map((f) => [f.id, f]));
      renderFaults();
    } catch (err) {
      $("chaos-msg").textContent = "listing faults failed: " + err;
    }
  }
  let faultsShown = null;
  function renderFaults() {
    // Rows are rebuilt only when the faults changed: a row its Clear button is being clicked
    // on must not be replaced by an identical one.
    const key = JSON.stringify([...state.faults.values()].map((f) => [f.id, f.spec, f.hit]));
    if (key === faultsShown) return;
    faultsShown = key;
    fill($("faults").tBodies[0], [...state.faults.values()].map((f) => {
      const b = el("button", { type: "button", class: "clear", "aria-label": "clear fault " + f.id }, "Clear");
      b.addEventListener("click", () => clearFault(f.id));
      return el("tr", { "data-fault": f.id },
        el("td", {}, f.id), el("td", {}, f.spec ? f.spec.kind : "?"), el("td", {}, details(f.spec)),
        el("td", {}, (f.hit || []).join(", ")), el("td", {}, b));
    }));
  }
  // A fault's parameters in words: delay, rate, fraction, steps, duration.
  function details(spec) {
    if (!spec) return "";
    const out = [];
    if (spec.delay_ms != null) out.push(spec.delay_ms + " ms/step");
    if (spec.after_steps != null) out.push("after " + spec.after_steps + " steps");
    if (spec.rate != null) out.push("rate " + spec.rate);
    if (spec.fraction != null) out.push("fraction " + spec.fraction);
    if (spec.actor) out.push(spec.actor);
    if (spec.nodes) out.push("nodes " + spec.nodes.join(", "));
    out.push(spec.duration_ms != null ? "for " + fmt(spec.duration_ms / 1000, 0) + " s" : "until cleared");
    return out.join(", ");
  }
  async function clearFault(id) {
    try {
      const res = await fetch("/chaos/faults/" + id, { method: "DELETE", headers: chaosHeaders(false) });
      $("chaos-msg").textContent = res.ok ? "cleared fault " + id : "clear: HTTP " + res.status;
    } catch (err) {
      $("chaos-msg").textContent = "clear failed: " + err;
    }
    loadFaults();
  }
  function renderChaos(view, all) {
    const on = view.chaos.enabled;
    $("chaos-section").hidden = !on;
    if (!on) return;
    $("chaos-token-label").hidden = !view.chaos.token;
    const sel = $("chaos-target");
    const want = ["any_busy"].concat(all.map(({ w }) => "worker:" + w.id), view.nodes.filter((n) => (n.workers || []).length).map((n) => "node:" + n.id));
    const have = [...sel.options].map((o) => o.value);
    if (want.join("|") !== have.join("|")) {
      const keep = sel.value;
      sel.replaceChildren(...want.map((v) => el("option", { value: v }, v === "any_busy" ? "busiest worker" : v.replace(":", " "))));
      if (want.includes(keep)) sel.value = keep;
    }
    if (!state.chaosLoaded) { state.chaosLoaded = true; loadFaults(); }
  }
  // What the amount field means for each kind (label, default, bounds); null: not used.
  const AMOUNT = {
    kill_actor: null, hang: null, panic: null, kill_node: null,
    slow: { label: "delay per step (ms)", value: 200, min: 1, max: 600000, step: 1 },
    fail_engine: { label: "after steps", value: 0, min: 0, max: 1000000, step: 1 },
    drop_kv_events: { label: "drop rate (0–1)", value: 0.5, min: 0, max: 1, step: 0.05 },
    fill_kv: { label: "KV fraction (0–1)", value: 0.5, min: 0, max: 1, step: 0.05 },
  };
  const LASTING = ["slow", "hang", "drop_kv_events", "fill_kv", "fail_engine"];
  function onKind() {
    const kind = $("chaos-kind").value;
    const a = AMOUNT[kind];
    const input = $("chaos-amount");
    $("chaos-amount-label").hidden = !a;
    if (a) {
      $("chaos-amount-text").textContent = a.label;
      Object.assign(input, { min: a.min, max: a.max, step: a.step, value: a.value });
    }
    $("chaos-duration-label").hidden = !LASTING.includes(kind);
  }
  $("chaos-kind").addEventListener("change", onKind);
  onKind();
  function faultSpec() {
    const kind = $("chaos-kind").value;
    const amount = Number($("chaos-amount").value);
    const secs = Number($("chaos-duration").value);
    const t = $("chaos-target").value;
    const spec = { kind };
    if (kind === "kill_actor") spec.actor = "replica";
    if (kind === "slow") spec.delay_ms = Math.round(amount);
    if (kind === "fail_engine") spec.after_steps = Math.round(amount);
    if (kind === "drop_kv_events") spec.rate = amount;
    if (kind === "fill_kv") spec.fraction = amount;
    spec.target = t === "any_busy" ? "any_busy" : t.startsWith("node:") ? { node: t.slice(5) } : { worker: t.slice(7) };
    if (LASTING.includes(kind) && secs > 0) spec.duration_ms = Math.round(secs * 1000);
    return spec;
  }
  $("chaos-form").addEventListener("invalid", (ev) => {
    $("chaos-msg").textContent = "not sent: " + (ev.target.labels && ev.target.labels[0] ? ev.target.labels[0].textContent.trim() + ": " : "") + ev.target.validationMessage;
  }, true);
  $("chaos-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const spec = faultSpec();
    try {
      const res = await fetch("/chaos/faults", { method: "POST", headers: chaosHeaders(true), body: JSON.stringify(spec) });
      const body = await res.json().catch(() => ({}));
      $("chaos-msg").textContent = res.ok ? "injected fault " + body.id : "inject: " + ((body.error && body.error.message) || "HTTP " + res.status);
    } catch (err) {
      $("chaos-msg").textContent = "inject failed: " + err;
    }
    loadFaults();
  });
  $("chaos-token").addEventListener("change", loadFaults);

  // ---- the stream ----
  // Every (re)connection starts with the gateway's recent history: start over from it.
  function reset() {
    state.series = [];
    state.last = null;
    state.lastLatency = null;
    state.placements = [];
    state.handoffs.clear();
    $("events").replaceChildren();
    for (const t of ["decisions", "transfers"]) $(t).tBodies[0].replaceChildren();
  }
  function connect() {
    const conn = $("conn");
    const es = new EventSource("/v1/fleet/live");
    es.addEventListener("open", () => { conn.textContent = "live"; conn.dataset.state = "open"; reset(); });
    es.addEventListener("view", (m) => onView(JSON.parse(m.data)));
    es.addEventListener("fleet", (m) => onFleet(JSON.parse(m.data)));
    es.addEventListener("error", () => { conn.textContent = "reconnecting…"; conn.dataset.state = "lost"; });
  }
  connect();
})();
