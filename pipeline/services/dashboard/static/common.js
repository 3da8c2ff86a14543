// dsh-pipeline dashboard: helpers shared by both pages (live streams, formatting, charts).
"use strict";

const PALETTE = ["#4ea1ff", "#3fb950", "#d29922", "#a371f7", "#f85149", "#39c5cf",
                 "#ff7b72", "#e3b341", "#8b949e", "#56d364"];
const REASON_COLORS = { completed: "#3fb950", aborted: "#d29922", blocked: "#e3b341",
  error: "#f85149", "max-tokens": "#a371f7", interrupted: "#ff7b72", unknown: "#8b949e" };

// An EventSource with a connection indicator. The browser reconnects by itself (the server
// sends "retry: 1000"); a stream the server closes is reopened the same way.
function liveStream(url, handlers, indicator) {
  const source = new EventSource(url);
  const show = (live, text) => {
    if (!indicator) return;
    indicator.classList.toggle("live", live);
    indicator.textContent = text;
    indicator.dataset.state = live ? "live" : "down";
  };
  source.onopen = () => show(true, "live");
  source.onerror = () => show(false, "reconnecting…");
  for (const [name, handler] of Object.entries(handlers)) {
    source.addEventListener(name, (e) => handler(JSON.parse(e.data), e));
  }
  return source;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function fmtInt(n) { return n == null ? "–" : Math.round(n).toLocaleString("en-US"); }

function fmtCompact(n) {
  if (n == null) return "–";
  const a = Math.abs(n);
  if (a >= 1e9) return `${+(n / 1e9).toFixed(1)}G`;
  if (a >= 1e6) return `${+(n / 1e6).toFixed(1)}M`;
  if (a >= 1e4) return `${+(n / 1e3).toFixed(0)}k`;
  if (a >= 1e3) return `${+(n / 1e3).toFixed(1)}k`;
  return a < 10 && !Number.isInteger(n) ? n.toFixed(1) : String(Math.round(n));
}

function fmtAgo(ms, now) {
  if (ms == null) return "–";
  const s = Math.max(0, (now - ms) / 1000);
  if (s < 1) return "now";
  if (s < 60) return `${Math.floor(s)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return new Date(ms).toISOString().slice(0, 16).replace("T", " ");
}

function fmtSeconds(s) {
  if (s == null) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  return `${(s / 60).toFixed(1)} min`;
}

// ---- charts: small canvas drawing, no library ----

function prepareCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 4, 6, 8, 10]) if (v <= m * p) return m * p;  // quarters stay round
  return 10 * p;
}

function drawEmpty(ctx, w, h, text) {
  ctx.fillStyle = "#8a96a3"; ctx.textAlign = "center";
  ctx.fillText(text, w / 2, h / 2);
}

function drawAxes(ctx, box, yMax, fmtY, t0, t1) {
  ctx.strokeStyle = "#2a3440"; ctx.fillStyle = "#8a96a3"; ctx.lineWidth = 1;
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = box.y + box.h - (box.h * i) / 4;
    ctx.beginPath(); ctx.moveTo(box.x, y + 0.5); ctx.lineTo(box.x + box.w, y + 0.5); ctx.stroke();
    ctx.fillText(fmtY((yMax * i) / 4), box.x - 4, y);
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  const span = (t1 - t0) / 1000;
  for (let i = 0; i <= 4; i++) {
    const x = box.x + (box.w * i) / 4;
    const ago = Math.round(span - (span * i) / 4);
    ctx.fillText(ago === 0 ? "now" : `-${ago >= 120 ? Math.round(ago / 60) + "m" : ago + "s"}`, x, box.y + box.h + 4);
  }
}

function drawLegend(ctx, names, colors, x, y, w) {
  ctx.textAlign = "left"; ctx.textBaseline = "middle";
  let cx = x;
  names.forEach((name, i) => {
    const width = ctx.measureText(name).width + 22;
    if (cx + width > x + w) return;
    ctx.fillStyle = colors[i]; ctx.fillRect(cx, y - 4, 10, 8);
    ctx.fillStyle = "#d8dee6"; ctx.fillText(name, cx + 14, y);
    cx += width;
  });
}

// series: [{name, color, points: [[t, v|null], ...]}]
function lineChart(canvas, series, opts) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const points = series.flatMap((s) => s.points.filter((p) => p[1] != null));
  canvas.dataset.points = String(points.length);
  if (!points.length) { drawEmpty(ctx, w, h, opts.empty || "no data yet"); return; }
  const box = { x: 44, y: 18, w: w - 54, h: h - 38 };
  const t1 = opts.now, t0 = t1 - opts.spanMs;
  let yMax = opts.yMax || niceMax(Math.max(...points.map((p) => p[1])));
  if (opts.integer) yMax = Math.max(4, Math.ceil(yMax / 4) * 4);  // whole-number ticks
  drawAxes(ctx, box, yMax, opts.fmtY || fmtCompact, t0, t1);
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.8; ctx.beginPath();
    let pen = false;
    for (const [t, v] of s.points) {
      if (v == null || t < t0) { pen = false; continue; }
      const x = box.x + ((t - t0) / (t1 - t0)) * box.w;
      const y = box.y + box.h - (Math.min(v, yMax) / yMax) * box.h;
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    }
    ctx.stroke();
    if (opts.dots) {  // sparse series (one value per bucket): mark each value
      ctx.fillStyle = s.color;
      for (const [t, v] of s.points) {
        if (v == null || t < t0) continue;
        const x = box.x + ((t - t0) / (t1 - t0)) * box.w;
        const y = box.y + box.h - (Math.min(v, yMax) / yMax) * box.h;
        ctx.beginPath(); ctx.arc(x, y, 2.5, 0, 2 * Math.PI); ctx.fill();
      }
    }
  }
  drawLegend(ctx, series.map((s) => s.name), series.map((s) => s.color), box.x, 8, box.w);
}

// buckets: [[t, {key: n}]]; stacked bars per bucket
function stackedBars(canvas, buckets, colors, opts) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const keys = [...new Set(buckets.flatMap(([, b]) => Object.keys(b)))].sort();
  const totals = buckets.map(([, b]) => Object.values(b).reduce((a, c) => a + c, 0));
  canvas.dataset.points = String(totals.filter((t) => t > 0).length);
  if (!keys.length) { drawEmpty(ctx, w, h, opts.empty || "no data yet"); return; }
  const box = { x: 44, y: 18, w: w - 54, h: h - 38 };
  const yMax = Math.max(4, Math.ceil(niceMax(Math.max(...totals)) / 4) * 4);
  drawAxes(ctx, box, yMax, fmtCompact, opts.now - opts.spanMs, opts.now);
  const bw = box.w / buckets.length;
  buckets.forEach(([, b], i) => {
    let y = box.y + box.h;
    for (const key of keys) {
      const v = b[key] || 0;
      if (!v) continue;
      const bh = (v / yMax) * box.h;
      ctx.fillStyle = colors[key] || "#8b949e";
      ctx.fillRect(box.x + i * bw + 1, y - bh, Math.max(1, bw - 2), bh);
      y -= bh;
    }
  });
  drawLegend(ctx, keys, keys.map((k) => colors[k] || "#8b949e"), box.x, 8, box.w);
}

// rows: [{label, values: [v...]}], one bar per value (names: legend for the values)
function barRows(canvas, rows, names, opts) {
  const { ctx, w, h } = prepareCanvas(canvas);
  const values = rows.flatMap((r) => r.values).filter((v) => v != null);
  canvas.dataset.points = String(values.length);
  if (!values.length) { drawEmpty(ctx, w, h, opts.empty || "no data yet"); return; }
  const labelW = opts.labelWidth || 90;
  const box = { x: labelW, y: 20, w: w - labelW - 70, h: h - 24 };
  const max = niceMax(Math.max(...values));
  const rowH = Math.min(40, box.h / rows.length);
  const barH = Math.max(3, (rowH - 6) / names.length);
  ctx.textBaseline = "middle";
  rows.forEach((row, i) => {
    const y0 = box.y + i * rowH;
    ctx.fillStyle = "#d8dee6"; ctx.textAlign = "right";
    ctx.fillText(row.label, labelW - 8, y0 + rowH / 2 - 2);
    row.values.forEach((v, j) => {
      const y = y0 + j * barH;
      const bw = v == null ? 0 : Math.max(1, (v / max) * box.w);
      ctx.fillStyle = PALETTE[j % PALETTE.length];
      ctx.fillRect(box.x, y, bw, barH - 1);
      ctx.fillStyle = "#8a96a3"; ctx.textAlign = "left";
      if (barH >= 9) ctx.fillText(v == null ? "–" : opts.fmt(v), box.x + bw + 4, y + barH / 2);
    });
  });
  drawLegend(ctx, names, names.map((_, j) => PALETTE[j % PALETTE.length]), box.x, 8, box.w);
}
