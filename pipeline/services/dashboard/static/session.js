// The session page: one session over SSE (/api/stream/sessions/{id}): a snapshot (its derived
// messages and fleet row, published by the processors), then its events from there on,
// rendered as a live transcript; the derived messages beside it when they differ (replaced
// ranges). State and tokens come from the fleet row; live events move the state badge ahead.
"use strict";

const sessionId = decodeURIComponent(location.pathname.replace(/^\/sessions\//, ""));
document.getElementById("sid").textContent = sessionId;
document.title = `dsh · ${sessionId}`;
const transcript = document.getElementById("transcript");
const pane = document.getElementById("transcript-pane");
const blocks = new Map();   // "turn/step/index" -> streaming element
const streamed = new Set(); // "turn/step" with chunks seen
const status = { state: "idle", turn: null, step: null, events: 0, tokensIn: 0, tokensOut: 0,
                 lastSeq: -1 };
let userChoice = null, derivedDiffers = false;  // userChoice: the toggle, once clicked

function stepKey(d) { return `${d.turn}/${d.step}`; }

function textOf(content) {
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return JSON.stringify(content);
  return content.map((b) => {
    if (b.type === "text" || b.type === "reasoning") return b.text;
    if (b.type === "tool-call" || b.type === "tool_use") return `→ ${b.name}(${b.arguments ?? JSON.stringify(b.input)})`;
    if (b.type === "tool-result" || b.type === "tool_result") return textOf(b.content);
    if (b.type === "image") return "[image]";
    return `[${b.type}]`;
  }).join("\n");
}

function pretty(raw) {
  try { return JSON.stringify(JSON.parse(raw), null, 2); } catch { return String(raw); }
}

function add(node) {
  const nearBottom = pane.scrollHeight - pane.scrollTop - pane.clientHeight < 80;
  transcript.append(node);
  if (nearBottom) pane.scrollTop = pane.scrollHeight;
}

function message(kind, who, text, seq) {
  return el("div", { class: `msg ${kind}`, "data-seq": String(seq) },
    el("span", { class: "who", text: who }), text);
}

function toolCall(name, callId, args, seq) {
  const node = el("div", { class: "tool call", "data-seq": String(seq) },
    el("div", { class: "name", text: "" }), el("pre"));
  finalCall(node, name, callId, args);
  return node;
}

// The final rendering of a tool call, whether it streamed in chunks or came whole.
function finalCall(node, name, callId, args) {
  node.classList.remove("streaming");
  if (callId) node.dataset.callId = callId;
  node.querySelector(".name").textContent = `tool call · ${name}${callId ? ` · ${callId}` : ""}`;
  node.querySelector("pre").textContent = pretty(args);
}

function callNode(callId) {
  return callId ? transcript.querySelector(`.tool.call[data-call-id="${CSS.escape(callId)}"]`) : null;
}

function toolResult(block, seq, errorCode) {
  const failed = block.isError || errorCode;
  return el("div", { class: `tool result${failed ? " failed" : ""}`, "data-seq": String(seq) },
    el("div", { class: "name", text: `result · ${block.toolCallId || ""}${errorCode ? ` · ${errorCode}` : ""}` }),
    el("pre", { text: textOf(block.content) }));
}

// One derived message of the snapshot, rendered as its events would have been.
function renderMessage(m, seq) {
  const blocks = Array.isArray(m.content) ? m.content : [{ type: "text", text: textOf(m.content) }];
  if (m.role === "assistant") {
    for (const b of blocks) {
      if (b.type === "tool-call") add(toolCall(b.name, b.id, b.arguments, seq));
      else if (b.type === "reasoning") add(message("reasoning", "reasoning", b.text, seq));
      else add(message("assistant", "assistant", textOf([b]), seq));
    }
  } else if (blocks.length && blocks.every((b) => b.type === "tool-result")) {
    for (const b of blocks) add(toolResult(b, seq, null));
  } else {
    const kind = (m.source || {}).kind;
    add(message("user", kind && kind !== "user" ? `user · ${kind}` : "user", textOf(m.content), seq));
  }
}

function onSnapshot(d) {
  transcript.replaceChildren(); blocks.clear(); streamed.clear();
  if (d.messages.length) {
    add(el("div", { class: "note", text: `derived messages up to #${d.atSeq} (projection v${d.version}), then live events` }));
  }
  d.messages.forEach((m, i) => renderMessage(m, d.seqs[i]));
  status.events = d.atSeq + 1;
  if (d.row) onRow(d.row);
  onDerived({ session: d.session, atSeq: d.atSeq, messages: d.messages, seqs: d.seqs, replaced: false, error: null });
  setBanner(d.processorsError ? `processors: ${d.processorsError}`
    : d.undecodable ? `${d.undecodable} undecodable derived records skipped: ${d.problems.at(-1) || ""}` : "");
  updateHead();
}

function onRow(r) {
  status.tokensIn = r.input_tokens || 0; status.tokensOut = r.output_tokens || 0;
  if ((r.last_seq ?? -1) >= status.lastSeq) {  // not behind the events already shown
    Object.assign(status, { state: r.state, turn: r.turn, step: r.step, lastSeq: r.last_seq ?? -1 });
    status.events = Math.max(status.events, (r.last_seq ?? -1) + 1);
  }
  updateHead();
}

function onChunk(ev) {
  const d = ev.data, c = d.chunk || {};
  const key = `${stepKey(d)}/${c.index}`;
  streamed.add(stepKey(d));
  if (c.type === "block-start") {
    const kind = c.blockType === "reasoning" ? "reasoning" : c.blockType === "tool-call" ? "tool" : "assistant";
    let node;
    if (kind === "tool") {
      node = el("div", { class: "tool call" }, el("div", { class: "name", text: "tool call (streaming)" }), el("pre"));
    } else {
      node = message(`${kind} streaming`, kind === "reasoning" ? "reasoning" : "assistant", "", ev.seq);
    }
    blocks.set(key, node); add(node);
  } else if (c.type === "text-delta" || c.type === "reasoning-delta") {
    let node = blocks.get(key);
    if (!node) { node = message(`${c.type === "text-delta" ? "assistant" : "reasoning"} streaming`, "assistant", "", ev.seq); blocks.set(key, node); add(node); }
    node.append(c.text);
    pane.scrollTop = pane.scrollHeight - pane.scrollTop - pane.clientHeight < 120 ? pane.scrollHeight : pane.scrollTop;
  } else if (c.type === "tool-call-delta") {
    const node = blocks.get(key);
    if (node) {
      if (c.name) node.querySelector(".name").textContent = `tool call · ${c.name}`;
      node.querySelector("pre").append(c.argumentsDelta || "");
    }
  } else if (c.type === "block-end") {
    const node = blocks.get(key), b = c.block || {};
    if (!node) return;
    node.classList.remove("streaming");
    // the final block is authoritative (deltas may have been cut by a retry)
    if ((b.type === "text" || b.type === "reasoning") && typeof b.text === "string") {
      node.replaceChildren(node.querySelector(".who"), b.text);
    } else if (b.type === "tool-call" && node.querySelector("pre")) {
      finalCall(node, b.name, b.id, b.arguments);
    }
  } else if (c.type === "finish") {
    for (const [k, node] of blocks) if (k.startsWith(`${stepKey(d)}/`)) node.classList.remove("streaming");
    const r = c.reason || {};
    if (r.kind === "error" || r.kind === "aborted") {
      const f = r.failure || {};
      add(el("div", { class: "note bad", text: `model call ${r.kind}: ${f.code || ""} ${f.message || ""}` }));
    }
  }
}

const RENDER = {
  "turn/start": (ev) => { Object.assign(status, { state: "in-turn", turn: ev.data.turn, step: null });
    add(el("div", { class: "turn-sep", text: `Turn ${ev.data.turn}` })); },
  "step/start": (ev) => { status.step = ev.data.step;
    add(el("div", { class: "step-sep", text: `step ${ev.data.step}` })); },
  "step/end": () => { status.step = null; },
  "turn/end": (ev) => {
    Object.assign(status, { state: "idle", step: null });
    const r = ev.data.reason || {};
    const detail = r.kind === "error" && r.error ? ` (${r.error.code}: ${r.error.message})`
      : r.kind === "aborted" && r.reason ? ` (${r.reason.kind})` : "";
    add(el("div", { class: `turn-end reason ${r.kind}`, text: `turn ${ev.data.turn} ended: ${r.kind}${detail}` }));
  },
  "user/message": (ev) => {
    const kind = (ev.data.source || {}).kind;
    add(message("user", kind && kind !== "user" ? `user · ${kind}` : "user", textOf(ev.data.content), ev.seq));
  },
  "assistant/chunk": onChunk,
  "assistant/message": (ev) => {
    const d = ev.data;
    if (!streamed.has(stepKey(d))) {
      renderMessage({ role: "assistant", content: d.message.content }, ev.seq);
    }
    if (d.interrupted) add(el("div", { class: "note bad", text: "assistant message interrupted" }));
  },
  // a call streamed in chunks, or shown by its message, is already there: one node per call
  "tool/call": (ev) => {
    const node = callNode(ev.data.callId);
    if (node) finalCall(node, ev.data.name, ev.data.callId, ev.data.arguments);
    else add(toolCall(ev.data.name, ev.data.callId, ev.data.arguments, ev.seq));
  },
  "tool/result": (ev) => {
    const block = ((ev.data.message || {}).content || [])[0] || {};
    add(toolResult(block, ev.seq, ev.data.error ? ev.data.error.code : null));
  },
  "request/header": (ev) => {
    const cfg = ((ev.data.header || {}).config) || {};
    add(el("div", { class: "note", text: `request header (${ev.data.reason}): ${cfg.provider || "?"} / ${cfg.model || "?"}` }));
  },
};

function onEvent(ev) {
  status.events = ev.seq + 1;
  if (ev.type !== "assistant/chunk") status.lastSeq = ev.seq;
  const render = RENDER[ev.type];
  if (render) render(ev);
  else add(el("div", { class: "note", text: `#${ev.seq} ${ev.type}` }));
  updateHead();
}

function updateHead() {
  const badge = document.getElementById("state");
  badge.className = `badge ${status.state}`;
  badge.textContent = status.state === "in-turn"
    ? (status.step != null ? `turn ${status.turn} · step ${status.step}` : `turn ${status.turn}`) : "idle";
  document.getElementById("stats").textContent =
    `${fmtInt(status.events)} events · ${fmtInt(status.tokensIn)} tokens in · ${fmtInt(status.tokensOut)} out`;
}

function onDerived(d) {
  derivedDiffers = d.replaced;
  const box = document.getElementById("derived");
  box.replaceChildren(...d.messages.map((m, i) => {
    const node = message(m.role === "assistant" ? "assistant" : "user", m.role, textOf(m.content), d.seqs[i]);
    node.prepend(el("span", { class: "seq", text: `#${d.seqs[i]}` }));
    return node;
  }));
  document.getElementById("derived-title").textContent = d.replaced
    ? `Derived messages: differ from the transcript (replaced ranges) · ${d.messages.length}`
    : `Derived messages (same as the transcript) · ${d.messages.length}`;
  if (d.error) setBanner(`derived messages stopped at ${d.error}`);
  layoutPanes();
}

function layoutPanes() {
  const visible = userChoice ?? derivedDiffers;
  document.getElementById("derived-pane").hidden = !visible;
  document.getElementById("cols").classList.toggle("single", !visible);
  document.getElementById("toggle-derived").textContent = visible ? "hide derived messages" : "show derived messages";
}

function setBanner(text) {
  const b = document.getElementById("banner");
  b.textContent = text || ""; b.classList.toggle("show", !!text);
}

document.getElementById("toggle-derived").addEventListener("click", () => {
  userChoice = !(userChoice ?? derivedDiffers); layoutPanes();
});

liveStream(`/api/stream/sessions/${encodeURIComponent(sessionId)}`, {
  snapshot: onSnapshot,
  event: onEvent,
  row: onRow,
  derived: onDerived,
  "caught-up": () => updateHead(),
  "stream-error": (d) => setBanner(`stream: ${d.message} (retrying)`),
}, document.getElementById("conn"));
