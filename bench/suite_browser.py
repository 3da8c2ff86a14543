"""Token -> browser (issue 21): a chunk appended by the driver -> the SSE event on its
session page's stream, many sessions streaming at once, the reader an SSE client in this
process (outside the dashboard's). Each run starts a fresh driver and dashboard process on
fresh topics (bench/bench_token_browser.py). The anchor is what a plain read_committed
consumer in this process saw of the same chunks in the same run: the part of the figure that
is the driver's transactions, not the dashboard."""

from __future__ import annotations

import bench_token_browser
from suite_core import Context, Figure
from suite_ratio import E2E_LABEL, kafka_e2e, log_ratio

# The target as a multiple of Kafka's EndToEndLatency p99 measured next to each run (issue 33).
BROWSER_RATIO = 15.0


def bench_browser(ctx: Context) -> list[Figure]:
    sessions, watchers = ctx.size(1000, 20), ctx.size(20, 5)
    chunk_ms = 100
    plain = "a plain read_committed consumer of the same chunks (appended -> readable)"
    total = Figure(f"Token -> browser: chunk appended -> SSE event p99, {sessions:,} sessions "
                   f"streaming, {watchers} pages open", "ms", [], anchor=plain,
                   higher_is_better=False, worst_counts=True,
                   goal=f"<= {BROWSER_RATIO:g}x {E2E_LABEL}, in every run (issues 21, 33)")
    median = Figure("Token -> browser: chunk appended -> SSE event p50", "ms", [],
                    anchor=plain + ", p50", higher_is_better=False)
    dashboard = Figure("Token -> browser: readable -> SSE event p99 (the dashboard's part)",
                       "ms", [], higher_is_better=False, worst_counts=True)
    for _ in range(ctx.latency_runs):
        anchor = kafka_e2e(ctx)   # interleaved: each run has its own
        result = bench_token_browser.run(ctx.bootstrap, sessions, watchers, chunk_ms)
        ctx.log(f"  token -> browser: {result}")
        if not result["chunks"] or result["watchers_ended"] < watchers:
            raise RuntimeError(f"token -> browser: not every watched turn arrived: {result}")
        total.ours.append(result["browser_ms_p99"])
        total.e2e_p99.append(anchor[1] if anchor else 0.0)
        log_ratio(ctx, "token -> browser p99", result["browser_ms_p99"], anchor, BROWSER_RATIO)
        total.anchor_values.append(result["readable_ms_p99"])
        median.ours.append(result["browser_ms_p50"])
        median.anchor_values.append(result["readable_ms_p50"])
        dashboard.ours.append(result["to_browser_ms_p99"])
    total.judge_ratios(BROWSER_RATIO)
    total.note = median.note = (
        f"`dsh-pipeline driver` (scripted echo reply, a chunk every {chunk_ms} ms, every "
        f"session's follow-up sent at once) and `dsh-pipeline dashboard` as processes; "
        f"{watchers} SSE clients on /api/stream/sessions/ID, opened before the follow-ups; "
        "arrival minus the chunk's time stamp (bench/bench_token_browser.py)")
    dashboard.note = ("per chunk: its arrival at the SSE client minus its arrival at the plain "
                      "consumer: the dashboard's tail, hub and stream")
    return [total, median, dashboard]
