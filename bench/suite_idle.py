"""Idle CPU (issue 21): a driver and a processors worker with nothing to do, each its own
process on fresh, empty topics, in % of one core (bench/bench_idle.py)."""

from __future__ import annotations

import bench_idle
from suite_core import Context, Figure

IDLE_GOAL_PCT = 2.0


def bench_idle_cpu(ctx: Context) -> list[Figure]:
    settle_s, seconds = ctx.size(20, 8), ctx.size(30, 3)
    figures = {
        key: Figure(f"Idle {name}: CPU, % of one core", "% core", [], higher_is_better=False,
                    worst_counts=True, goal=f"<= {IDLE_GOAL_PCT:g}% in every run (issue 21)")
        for key, name in (("driver_idle_pct_core", "driver"),
                          ("worker_idle_pct_core", "processors worker"))}
    for run in range(ctx.runs):
        measured = bench_idle.measure(ctx.bootstrap, seconds, settle_s)
        ctx.log(f"  idle run {run + 1}: {measured}")
        for key, figure in figures.items():
            figure.ours.append(measured[key])
    for figure in figures.values():
        figure.judge(IDLE_GOAL_PCT)
        figure.note = (f"user + system time from /proc over {seconds} s, once {settle_s} s of "
                       "start-up have passed; empty inbox and session topics, 6 partitions")
    return list(figures.values())
