// The fleet page: rows and charts pushed over one SSE stream (/api/stream/fleet).
"use strict";

const rows = new Map();          // session id -> row JSON
const rowNodes = new Map();      // session id -> <tr>
let sortKey = "last_activity_ms", sortDesc = true, lastCharts = null;
const tbody = document.querySelector("#fleet tbody");
const search = document.getElementById("search");
const filter = document.getElementById("filter");

function stateText(r) {
  if (r.state !== "in-turn") return "idle";
  if (r.approval_call_id) return `turn ${r.turn} · waits for approval`;
  if (r.provider_wait) return `turn ${r.turn} · waits for provider ${r.provider_wait} (${fmtAgo(r.provider_wait_since_ms, Date.now())})`;
  return r.step != null ? `turn ${r.turn} · step ${r.step}` : `turn ${r.turn}`;
}

function errorCount(r) { return (r.turn_errors || 0) + (r.tool_errors || 0); }

function matches(r) {
  const f = filter.value;
  if (f === "in-turn" && r.state !== "in-turn") return false;
  if (f === "idle" && r.state === "in-turn") return false;
  if (f === "errors" && !errorCount(r)) return false;
  const q = search.value.trim().toLowerCase();
  if (!q) return true;
  return [r.session_id, r.title, r.tenant, r.model, r.last_error, r.last_end_reason]
    .some((v) => v && String(v).toLowerCase().includes(q));
}

function renderRow(r, tr) {
  const now = Date.now();
  const errors = errorCount(r);
  const idCell = el("td", { class: "sid", title: r.session_id },
    el("a", { href: `/sessions/${encodeURIComponent(r.session_id)}`, text: r.session_id }),
    r.title ? el("span", { class: "title", text: r.title }) : null);
  const reason = r.last_end_reason || "";
  tr.replaceChildren(
    idCell,
    el("td", { "data-col": "state" }, el("span", { class: `badge ${r.state}`, text: stateText(r) })),
    el("td", {}, el("span", { class: `reason ${reason}`, text: reason || "–" })),
    el("td", { "data-ago": String(r.last_activity_ms ?? ""), text: fmtAgo(r.last_activity_ms, now),
               title: r.last_activity_ms ? new Date(r.last_activity_ms).toISOString() : "" }),
    el("td", { class: "num", text: fmtInt(r.turns) }),
    el("td", { class: "num", text: fmtInt(r.steps) }),
    el("td", { class: "num", text: fmtInt(r.input_tokens) }),
    el("td", { class: "num", text: fmtInt(r.output_tokens) }),
    el("td", { class: `num ${errors ? "err" : "muted"}`, text: errors ? `${errors}` : "0",
               title: r.last_error ? `last: ${r.last_error}` : "" }),
    el("td", { class: "muted", text: r.model || "–" }),
    el("td", { class: "muted", text: r.tenant || "–" }),
    el("td", { class: "num muted", text: r.partition >= 0 ? String(r.partition) : "–" }));
  tr.dataset.session = r.session_id;
  tr.dataset.state = r.state;
}

function compare(a, b) {
  const key = sortKey;
  const va = key === "errors" ? errorCount(a) : key === "state" ? stateText(a) : a[key];
  const vb = key === "errors" ? errorCount(b) : key === "state" ? stateText(b) : b[key];
  if (va === vb) return a.session_id < b.session_id ? -1 : 1;
  if (va == null) return 1;
  if (vb == null) return -1;
  return (va < vb ? -1 : 1) * (sortDesc ? -1 : 1);
}

function layout() {
  const shown = [...rows.values()].filter(matches).sort(compare);
  const wanted = shown.map((r) => rowNodes.get(r.session_id));
  tbody.replaceChildren(...wanted);
  document.getElementById("count").textContent = `${shown.length} of ${rows.size}`;
  document.getElementById("empty").style.display = rows.size ? "none" : "block";
  updateKpis();
  renderApprovals();
}

// Calls waiting for a person: approve or deny through the dashboard's one POST route (it
// needs the dashboard's token; the browser sends the basic-auth credentials it was given).
const approvalNodes = new Map();  // "session\u0000call" -> <tr> (kept: a typed reason stays)
function renderApprovals() {
  const waiting = [...rows.values()].filter((r) => r.approval_call_id)
    .sort((a, b) => (a.approval_since_ms || 0) - (b.approval_since_ms || 0));
  const now = Date.now();
  const wanted = waiting.map((r) => {
    const key = `${r.session_id}\u0000${r.approval_call_id}`;
    let tr = approvalNodes.get(key);
    if (!tr) { tr = approvalRow(r); approvalNodes.set(key, tr); }
    tr.querySelector("td[data-ago]").textContent = fmtAgo(r.approval_since_ms, now);
    return tr;
  });
  const keep = new Set(wanted);
  for (const [key, tr] of approvalNodes) if (!keep.has(tr)) approvalNodes.delete(key);
  document.querySelector("#approvals-table tbody").replaceChildren(...wanted);
  document.getElementById("approvals").hidden = !waiting.length;
}

function approvalRow(r) {
  const reason = el("input", { type: "text", class: "reason-input", placeholder: "why (optional)" });
  const outcome = el("span", { class: "muted", "data-outcome": "" });
  const send = (decision) => async () => {
    outcome.textContent = "sending…";
    const url = `/api/sessions/${encodeURIComponent(r.session_id)}/approvals/${encodeURIComponent(r.approval_call_id)}`;
    try {
      const res = await fetch(url, { method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ decision, reason: reason.value || null }) });
      const body = await res.json();
      outcome.textContent = res.ok ? `${decision} sent` : `refused: ${body.error}`;
    } catch (err) { outcome.textContent = `failed: ${err}`; }
  };
  return el("tr", { "data-approval": r.session_id, "data-call": r.approval_call_id },
    el("td", { class: "sid" }, el("a", { href: `/sessions/${encodeURIComponent(r.session_id)}`, text: r.session_id })),
    el("td", { text: r.approval_tool || "?" }),
    el("td", { class: "muted", text: r.approval_call_id }),
    el("td", { "data-ago": "" }),
    el("td", {}, reason),
    el("td", {}, el("button", { class: "approve", text: "Approve", onclick: send("approve") }),
      " ", el("button", { class: "deny", text: "Deny", onclick: send("deny") }), " ", outcome));
}

function upsert(list, flash) {
  for (const r of list) {
    rows.set(r.session_id, r);
    let tr = rowNodes.get(r.session_id);
    if (!tr) { tr = el("tr"); rowNodes.set(r.session_id, tr); }
    renderRow(r, tr);
    if (flash) { tr.classList.remove("flash"); void tr.offsetWidth; tr.classList.add("flash"); }
  }
  layout();
}

function updateKpis() {
  let inTurn = 0, turns = 0, errors = 0;
  for (const r of rows.values()) {
    inTurn += r.state === "in-turn"; turns += r.turns || 0; errors += errorCount(r);
  }
  document.getElementById("k-sessions").textContent = fmtInt(rows.size);
  document.getElementById("k-inturn").textContent = fmtInt(inTurn);
  document.getElementById("k-turns").textContent = fmtInt(turns);
  document.getElementById("k-errors").textContent = fmtInt(errors);
}

function drawCharts(c) {
  lastCharts = c;
  const tokenSpan = c.tokens.length * c.tokenBucketMs;
  const models = [...new Set(c.tokens.flatMap(([, b]) => Object.keys(b)))].sort();
  const perSecond = 1000 / c.tokenBucketMs;
  // tokens/s: the last complete buckets (the current one is still filling)
  const series = models.map((m, i) => ({ name: m, color: PALETTE[i % PALETTE.length],
    points: c.tokens.slice(0, -1).map(([t, b]) => [t + c.tokenBucketMs, (b[m] || 0) * perSecond]) }));
  lineChart(document.getElementById("c-tokens"), series,
    { now: c.now, spanMs: tokenSpan, empty: "no tokens yet" });
  const recent = c.tokens.slice(-6, -1);
  const tps = recent.reduce((a, [, b]) => a + Object.values(b).reduce((x, y) => x + y, 0), 0)
    / Math.max(1, recent.length) * perSecond;
  document.getElementById("k-tps").textContent = fmtInt(tps);
  lineChart(document.getElementById("c-inflight"),
    [{ name: "turns in flight", color: PALETTE[3], points: c.inFlight }],
    { now: c.now, spanMs: 300000, integer: true, empty: "waiting for samples" });
  stackedBars(document.getElementById("c-reasons"), c.endReasons, REASON_COLORS,
    { now: c.now, spanMs: c.endReasons.length * c.eventBucketMs, empty: "no turn ended yet" });
  const q = c.latency.quantiles.map((x) => `p${Math.round(x * 100)}`);
  barRows(document.getElementById("c-latency"),
    [{ label: "step", values: c.latency.step }, { label: "turn", values: c.latency.turn }],
    q, { fmt: fmtSeconds, labelWidth: 50, empty: "no step ended in the last 2 min" });
  lineChart(document.getElementById("c-toolerr"),
    [{ name: "errors / results", color: PALETTE[4],
       points: c.toolErrorRate.map(([t, v]) => [t + c.eventBucketMs, v == null ? null : v * 100]) }],
    { now: c.now, spanMs: c.toolErrorRate.length * c.eventBucketMs, yMax: 100,
      fmtY: (v) => `${Math.round(v)}%`, dots: true, empty: "no tool result yet" });
  const lagRows = c.lag.map((s) => ({ label: `${shorten(s.name || s.group)} · ${shortTopic(s.topic)}[${s.partition}]`,
                                      values: [s.seconds] }));
  barRows(document.getElementById("c-lag"), lagRows.slice(0, 12), ["seconds behind"],
    { fmt: fmtSeconds, labelWidth: 250, empty: "no consumer group on the topics yet" });
  const maxLag = c.lag.reduce((a, s) => Math.max(a, s.seconds), 0);
  document.getElementById("k-lag").textContent = c.lag.length ? fmtSeconds(maxLag) : "–";
}

function shorten(s) { return s.length > 20 ? `…${s.slice(-19)}` : s; }
function shortTopic(t) { return t.replace(/^.*?(session-events|inbox)$/, "$1"); }

// The reader's problems, most important first: no processors, no outputs, no live tail.
function showProblems(d) {
  const text = d.processorsError ? `processors: ${d.processorsError}`
    : d.outputsError ? `outputs: ${d.outputsError}`
    : d.feedError ? `live tail: ${d.feedError}`
    : d.ready === false ? "reading the fleet from the processors' outputs…" : "";
  setBanner(text);
}

function setBanner(text) {
  const b = document.getElementById("banner");
  b.textContent = text || ""; b.classList.toggle("show", !!text);
}

document.querySelectorAll("th[data-sort]").forEach((th) => th.addEventListener("click", () => {
  const key = th.dataset.sort;
  sortDesc = key === sortKey ? !sortDesc : true; sortKey = key; layout();
}));
search.addEventListener("input", layout);
filter.addEventListener("change", layout);
window.addEventListener("resize", () => lastCharts && drawCharts(lastCharts));
// "n s ago" only: a local re-render of the relative times, no request
setInterval(() => {
  const now = Date.now();
  tbody.querySelectorAll("td[data-ago]").forEach((td) => {
    const ms = td.dataset.ago ? Number(td.dataset.ago) : null;
    td.textContent = fmtAgo(ms, now);
  });
}, 1000);

liveStream("/api/stream/fleet", {
  snapshot: (d) => {
    rows.clear(); rowNodes.clear();
    showProblems(d);
    upsert(d.sessions, false);
  },
  status: showProblems,
  sessions: (list) => upsert(list, true),
  charts: drawCharts,
}, document.getElementById("conn"));

// --- usage and cost by tenant (GET /api/usage, every 5 s) ---------------------------------

const usageBody = document.querySelector("#usage-table tbody");
const usageSpan = document.getElementById("usage-span");
let lastUsage = null;

function fmtCost(nanos) {
  // nano-units of the price table's currency, as exact decimals (no float rounding)
  if (nanos == null) return "–";
  const text = String(nanos).padStart(10, "0");
  return `${text.slice(0, -9)}.${text.slice(-9)}`;
}

function renderUsage() {
  const rows = (lastUsage && lastUsage[usageSpan.value]) || [];
  usageBody.replaceChildren(...rows.map((u) => el("tr", {},
    el("td", { text: u.tenant === "" ? "(default)" : u.tenant }),
    el("td", { text: `${u.provider}/${u.model}` }),
    el("td", { class: "num", text: fmtInt(u.inputTokens) }),
    el("td", { class: "num", text: fmtInt(u.cachedInputTokens) }),
    el("td", { class: "num", text: fmtInt(u.cacheWriteTokens) }),
    el("td", { class: "num", text: fmtInt(u.outputTokens) }),
    el("td", { class: "num", text: fmtInt(u.calls) }),
    el("td", { class: "num", text: fmtCost(u.costNanos),
               title: u.unpricedCalls ? "partial: some calls had no price" : "" }),
    el("td", { class: `num ${u.unpricedCalls ? "err" : "muted"}`, text: fmtInt(u.unpricedCalls) }))));
  document.getElementById("usage-empty").hidden = rows.length > 0;
}

async function pollUsage() {
  try {
    const res = await fetch("/api/usage", { credentials: "same-origin" });
    if (res.ok) { lastUsage = await res.json(); renderUsage(); }
  } catch (e) { /* the banner shows connection problems; try again at the next poll */ }
}

usageSpan.addEventListener("change", renderUsage);
pollUsage();
setInterval(pollUsage, 5000);
