// The ratchet job dashboard: plain browser JavaScript, no build step, no network beyond this
// job's own API. Data is written into the page with textContent only (never as HTML).
"use strict";

const REFRESH_MS = 2000;
const TOKEN_KEY = "ratchet.rest-token";
const state = { view: "overview", key: null, keyType: null, trace: null, lastRefresh: 0, needsToken: false };

// -- the API ---------------------------------------------------------------------------------

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers["Authorization"] = "Bearer " + token;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  if (resp.status === 401) throw new Unauthorized("the API wants a token");
  const body = resp.status === 204 ? null : await resp.json().catch(() => null);
  if (!resp.ok) {
    const detail = body && body.detail ? body.detail : "HTTP " + resp.status;
    const err = new Error(typeof detail === "string" ? detail : JSON.stringify(detail));
    err.status = resp.status;
    throw err;
  }
  return body;
}

// -- small DOM helpers -----------------------------------------------------------------------

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fill(tbody, rows, emptyText, columns) {
  tbody.replaceChildren();
  if (!rows.length) {
    tbody.append(el("tr", {}, el("td", { colspan: String(columns), class: "muted" }, emptyText)));
    return;
  }
  for (const cells of rows) tbody.append(el("tr", {}, ...cells.map((c) => el("td", {}, c))));
}

function fmtNumber(n) {
  if (n === null || n === undefined) return "–";
  return Number.isInteger(n) ? n.toLocaleString("en") : Number(n).toFixed(1);
}

function fmtTime(t) {
  if (t === null || t === undefined) return "–";
  return new Date(t * 1000).toLocaleString();
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "";
  return s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s";
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  if (b < 1024) return b + " B";
  if (b < 1048576) return (b / 1024).toFixed(1) + " KiB";
  return (b / 1048576).toFixed(1) + " MiB";
}

function json(v) {
  return JSON.stringify(v);
}

function keyText(k) {
  return typeof k === "string" ? k : JSON.stringify(k);
}

// The string key "1" and the integer key 1 are two keys of one text: a text that reads as an
// integer (as ratchet's int_text) names either, and the API is told which with ?key_type=.
const INT_TEXT = /^(0|-?[1-9][0-9]*)$/;

function typeOf(k) {
  return typeof k === "number" ? "int" : "str";
}

function typed(key, keyType) {
  return keyType === "str" || keyType === "int" ? (INT_TEXT.test(key) ? keyType : null) : null;
}

function typeQuery(key, keyType) {
  const t = typed(key, keyType);
  return t ? "?key_type=" + t : "";
}

function keyLabel(key, keyType) {
  const t = typed(key, keyType);
  return t ? key + " (" + t + ")" : key;
}

function traceLink(key, seq, keyType) {
  return el("a", { href: "#/trace/" + encodeURIComponent(key) + "/" + seq + typeQuery(key, keyType) }, String(seq));
}

function keyLink(key, keyType) {
  return el("a", { href: "#/keys/" + encodeURIComponent(key) + typeQuery(key, keyType) }, keyLabel(key, keyType));
}

// -- charts (inline SVG) ---------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function drawChart(svg, series, unit) {
  // series: [{points: [[x, y], ...], cls}] ; x in seconds, y >= 0
  svg.replaceChildren();
  const all = series.flatMap((s) => s.points);
  if (all.length < 2) {
    const t = svgEl("text", { x: "10", y: "80" });
    t.textContent = "waiting for data (a point per checkpoint)";
    svg.append(t);
    return;
  }
  const xs = all.map((p) => p[0]);
  const x0 = Math.min(...xs);
  const x1 = Math.max(...xs) || x0 + 1;
  const ymax = Math.max(1e-9, ...all.map((p) => p[1]));
  const W = 600, H = 160, pad = 16;
  for (const s of series) {
    if (s.points.length < 2) continue;
    const d = s.points
      .map(([x, y], i) => {
        const px = ((x - x0) / (x1 - x0 || 1)) * W;
        const py = H - pad - (y / ymax) * (H - 2 * pad);
        return (i ? "L" : "M") + px.toFixed(1) + " " + py.toFixed(1);
      })
      .join(" ");
    svg.append(svgEl("path", { d, class: s.cls }));
  }
  const label = svgEl("text", { x: "4", y: "12" });
  label.textContent = "max " + fmtNumber(ymax) + " " + unit;
  svg.append(label);
}

// -- views -----------------------------------------------------------------------------------

async function refreshOverview() {
  const [job, history] = await Promise.all([api("/v1/job"), api("/v1/job/history")]);
  const badge = $("job-state");
  badge.textContent = job.state;
  badge.dataset.state = job.state;
  const up = job.worker_uptime_seconds;
  $("job-line").textContent =
    (job.worker_pid ? "worker pid " + job.worker_pid : "no worker") +
    (up !== null && up !== undefined ? ", up " + fmtDuration(up) : "") +
    (job.last_exit ? "; last exit: " + job.last_exit : "");
  $("fig-in-flight").textContent = fmtNumber(job.in_flight_runs);
  $("fig-queued").textContent = fmtNumber(job.queued_inputs);
  $("fig-waiting").textContent = fmtNumber(job.waiting ? job.waiting.length : null);
  $("fig-restarts").textContent = fmtNumber(job.restarts);
  const paused = job.paused || [];
  $("paused").hidden = !paused.length;
  $("paused").textContent = paused
    .map((p) => "paused: " + p.resource + " unavailable since " + fmtTime(p.since) + " (" + p.error + ")")
    .join("; ");

  const samples = history.samples;
  const last = samples.length ? samples[samples.length - 1] : null;
  for (const [id, name] of [
    ["fig-inputs", "inputs"],
    ["fig-runs-completed", "runs_completed"],
    ["fig-outputs", "outputs"],
    ["fig-runs-failed", "runs_failed"],
    ["fig-dead-letters", "dead_letters"],
  ]) {
    $(id).textContent = last ? fmtNumber(last[name]) : "–";
  }
  const rate = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = samples[i].t - samples[i - 1].t;
    if (dt > 0) rate.push([samples[i].t, Math.max(0, samples[i].runs_completed - samples[i - 1].runs_completed) / dt]);
  }
  drawChart($("chart-throughput"), [{ points: rate, cls: "line" }], "runs/s");
  const seen = new Set();
  const durations = [];
  for (const s of samples) {
    const c = s.checkpoint;
    if (c && c.id !== null && !seen.has(c.id)) {
      seen.add(c.id);
      durations.push([s.t, c.duration_ms || 0]);
    }
  }
  drawChart($("chart-checkpoints"), [{ points: durations, cls: "line" }], "ms");
  const c = last && last.checkpoint;
  $("checkpoint-latest").textContent = c
    ? "latest checkpoint " + c.id + ": " + fmtNumber(c.duration_ms) + " ms, " + fmtBytes(c.size_bytes)
    : "no checkpoint yet";
}

async function refreshKeys() {
  const q = $("key-search").value.trim();
  const data = await api("/v1/keys?limit=200" + (q ? "&contains=" + encodeURIComponent(q) : ""));
  $("key-count").textContent =
    data.total + (data.total === 1 ? " key" : " keys") + (data.total > data.keys.length ? ", first " + data.keys.length + " shown" : "");
  const list = $("key-list");
  const types = data.key_types || [];
  list.replaceChildren(
    ...data.keys.map((k, i) => {
      const selected = k === state.key && (state.keyType === null || types[i] === state.keyType);
      return el("li", { class: selected ? "selected" : "", "data-key": k, "data-key-type": types[i] }, keyLink(k, types[i]));
    })
  );
  if (state.key !== null) await showKey(state.key, state.keyType);
}

async function showKey(key, keyType) {
  $("key-title").textContent = "Key " + keyLabel(key, keyType);
  const table = $("memory-table");
  const empty = $("memory-empty");
  const which = typeQuery(key, keyType);
  try {
    const mem = await api("/v1/keys/" + encodeURIComponent(key) + "/memory" + which);
    fill(
      table.querySelector("tbody"),
      mem.fields.map((f) => [f.path, f.type, el("span", { class: "value-cell" }, json(f.value))]),
      "no fields",
      3
    );
    table.hidden = false;
    empty.hidden = true;
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    table.hidden = true;
    empty.hidden = false;
    empty.textContent = err.message;
  }
  $("key-runs-title").hidden = false;
  let runs;
  try {
    runs = await api("/v1/keys/" + encodeURIComponent(key) + "/runs" + which);
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    $("key-runs").replaceChildren(el("li", { class: "muted" }, err.message));
    return;
  }
  $("key-runs").replaceChildren(
    ...(runs.length
      ? runs.map((r) =>
          el("li", {}, "input ", traceLink(key, r.seq, r.key_type || keyType), " ", el("span", { class: "status-" + r.status }, r.status),
             " · " + fmtTime(r.completed_at) + " · " + r.tasks + " task(s)")
        )
      : [el("li", { class: "muted" }, "no kept traces")])
  );
}

async function refreshRuns() {
  const runs = await api("/v1/runs?recent=50");
  fill(
    $("runs-in-flight").querySelector("tbody"),
    runs.in_flight.map((r) => [keyLabel(keyText(r.key), typeOf(r.key)), String(r.seq), fmtNumber(r.journaled_tasks),
      fmtNumber(r.call_records) + " (" + fmtNumber(r.calls_returned) + ")", r.agent_version || "current"]),
    "no run in flight", 5
  );
  fill(
    $("runs-waiting").querySelector("tbody"),
    runs.waiting.map((w) => [keyLabel(keyText(w.key), typeOf(w.key)), String(w.seq), w.task || "", w.on, fmtTime(w.since), w.until ? fmtTime(w.until) : "no deadline"]),
    "no run waiting", 6
  );
  fill(
    $("runs-recent").querySelector("tbody"),
    runs.recent.map((r) => [keyLink(r.key, r.key_type), traceLink(r.key, r.seq, r.key_type), fmtTime(r.completed_at),
      el("span", { class: "status-" + r.status }, r.status), fmtNumber(r.tasks)]),
    "no completed run with a kept trace", 5
  );
}

function fieldsText(obj, skip) {
  return Object.entries(obj)
    .filter(([k]) => !skip.includes(k))
    .map(([k, v]) => k + "=" + (typeof v === "string" ? v : json(v)))
    .join(" ");
}

async function showTrace(key, seq, keyType) {
  $("trace-title").textContent = "Run of key " + keyLabel(key, keyType) + ", input " + seq;
  const tree = $("trace-tree");
  tree.replaceChildren();
  let t;
  try {
    t = await api("/v1/keys/" + encodeURIComponent(key) + "/runs/" + seq + "/trace" + typeQuery(key, keyType));
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    $("trace-summary").textContent = err.message;
    return;
  }
  const total = t.tasks.reduce((a, x) => a + (x.duration || 0), 0);
  $("trace-summary").textContent =
    t.status + " · completed " + fmtTime(t.completed_at) + " · " + t.tasks.length + " task(s), " + fmtDuration(total) + " in actions";
  for (const task of t.tasks) {
    const head = el("div", { class: "task-head" }, task.action, " ",
      el("span", { class: "muted" }, "on " + task.on + " · " + fmtDuration(task.duration)),
      el("span", { class: "tag " + (task.replayed ? "replayed" : "executed") }, task.replayed ? "replayed from journal" : "executed"),
      task.attempts && task.attempts > 1 ? el("span", { class: "tag error" }, task.attempts + " attempts") : null);
    const details = el("ul");
    for (const call of task.calls || []) {
      details.append(el("li", { class: call.error ? "error" : "" }, "call " + (call.fn || "?") + " " + fieldsText(call, ["fn"])));
    }
    for (const note of task.notes || []) {
      details.append(el("li", {}, (note.kind || "note") + " " + fieldsText(note, ["kind"])));
    }
    for (const op of task.memory || []) {
      const name = { s: "set", o: "new object", d: "delete", e: "expire" }[op[0]] || op[0];
      details.append(el("li", {}, "memory " + name + " " + op[1] + (op.length > 2 ? " = " + json(op[2]) : "")));
    }
    for (const ev of task.events || []) details.append(el("li", {}, "sent " + (typeof ev === "string" ? ev : json(ev))));
    tree.append(el("li", { class: "task", "data-action": task.action }, head, el("div", { class: "muted" }, "task " + task.task), details));
  }
}

async function refreshDeadLetters() {
  const letters = await api("/v1/dead-letters");
  const waiting = letters.filter((d) => d.redriven_as === null || d.redriven_as === undefined);
  $("nav-dead").textContent = waiting.length ? String(waiting.length) : "";
  if (state.view !== "dead-letters") return;
  fill(
    $("dead-letters").querySelector("tbody"),
    letters.map((d) => [String(d.id), d.kind, keyLabel(keyText(d.key), d.key_type), d.seq === null ? "" : String(d.seq), d.reason, fmtTime(d.at),
      d.redriven_as !== null && d.redriven_as !== undefined ? "redriven as input " + d.redriven_as
        : d.redrive_requested ? "requested"
        : el("button", { type: "button", class: "redrive", onclick: () => redrive({ id: d.id }) }, "redrive")]),
    "no dead letters", 7
  );
}

async function redrive(body) {
  try {
    const r = await api("/v1/dead-letters/redrive", { method: "POST", body });
    $("redrive-result").textContent = r.marked + " dead letter(s) marked for redrive";
  } catch (err) {
    $("redrive-result").textContent = err.message;
  }
  await refreshDeadLetters();
}

async function refreshApprovals() {
  const approvals = await api("/v1/approvals");
  $("nav-approvals").textContent = approvals.length ? String(approvals.length) : "";
  if (state.view !== "approvals") return;
  fill(
    $("approvals").querySelector("tbody"),
    approvals.map((a) => [keyLabel(keyText(a.key), typeOf(a.key)), String(a.seq), a.tool || "?",
      el("span", { class: "value-cell" }, json(a.arguments)), fmtTime(a.since),
      el("span", {},
        el("button", { type: "button", class: "approve", onclick: () => decide(a, true) }, "approve"), " ",
        el("button", { type: "button", class: "reject", onclick: () => decide(a, false) }, "reject"))]),
    "nothing waits for approval", 6
  );
}

async function decide(a, approved) {
  const value = approved ? { approved: true } : { approved: false, reason: "rejected in the dashboard" };
  try {
    // The approval is for its own key: of the string key "7" and the integer key 7 waiting
    // alike, the other one's run must not take it (and the API refuses to guess).
    const path = "/v1/keys/" + encodeURIComponent(keyText(a.key)) + "/signals/" + encodeURIComponent(a.signal);
    await api(path + "?key_type=" + typeOf(a.key), {
      method: "POST",
      body: { value },
    });
    $("approval-result").textContent = (approved ? "approved " : "rejected ") + (a.tool || "call") + " for key " + keyLabel(keyText(a.key), typeOf(a.key));
  } catch (err) {
    $("approval-result").textContent = err.message;
  }
  await refreshApprovals();
}

// -- routing and the refresh loop ------------------------------------------------------------

function route() {
  // #/keys/KEY or #/trace/KEY/SEQ, each part encoded; then ?key_type=str|int for a key whose
  // text is also the other key's (a "?" in the key itself is encoded, so the first is ours).
  const hash = location.hash.replace(/^#\/?/, "");
  const q = hash.indexOf("?");
  const parts = (q < 0 ? hash : hash.slice(0, q)).split("/").map(decodeURIComponent);
  const keyType = new URLSearchParams(q < 0 ? "" : hash.slice(q + 1)).get("key_type");
  let view = parts[0] || "overview";
  state.key = null;
  state.keyType = keyType === "str" || keyType === "int" ? keyType : null;
  state.trace = null;
  if (view === "keys" && parts.length > 1) state.key = parts.slice(1).join("/");
  if (view === "trace") {
    state.trace = { key: parts.slice(1, -1).join("/"), seq: Number(parts[parts.length - 1]), keyType: state.keyType };
  }
  if (!["overview", "keys", "runs", "trace", "dead-letters", "approvals"].includes(view)) view = "overview";
  state.view = view;
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== "view-" + view;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  refresh(true);
}

let refreshing = false;

async function refresh(all = false) {
  if (refreshing || state.needsToken) return;
  refreshing = true;
  try {
    await refreshOverview();
    await refreshDeadLetters();
    await refreshApprovals();
    if (state.view === "runs") await refreshRuns();
    if (state.view === "keys" && all) await refreshKeys();
    if (state.view === "trace" && all) await showTrace(state.trace.key, state.trace.seq, state.trace.keyType);
    $("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "true";
  } catch (err) {
    if (err instanceof Unauthorized) askToken();
    else $("refreshed").textContent = "update failed: " + err.message;
  } finally {
    refreshing = false;
  }
}

function askToken(message) {
  state.needsToken = true;
  $("token-form").hidden = false;
  $("token-error").textContent = message || (sessionStorage.getItem(TOKEN_KEY) ? "that token was refused" : "");
}

function init() {
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
    state.needsToken = false;
    $("token-form").hidden = true;
    refresh(true);
  });
  let searchTimer = null;
  $("key-search").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => refreshKeys().catch((err) => err instanceof Unauthorized && askToken()), 200);
  });
  $("redrive-all").addEventListener("click", () => redrive({ all: true }));
  window.addEventListener("hashchange", route);
  route();
  setInterval(() => refresh(false), REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", init);
