"""The suite's provider-budget benchmark (issue 30): two driver processes under 10x overload
of a rate-limited provider, ten tenants of which one asks ten times as much."""

from __future__ import annotations

import json
import subprocess
import sys

from suite_core import BENCH_DIR, Context, Figure

# (sessions, rpm, seconds, burst_s): the run, and the quick suite's small one
FULL = (1000, 300, 150, 60)
QUICK = (60, 60, 15, 5)


def budget_run_in_child(bootstrap: str, shape: tuple[int, int, int, int]) -> dict[str, float]:
    """One run of bench/bench_provider_budget.py in a process of its own."""
    sessions, rpm, seconds, burst_s = shape
    done = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_provider_budget.py"), "--bootstrap", bootstrap,
         "--sessions", str(sessions), "--rpm", str(rpm), "--seconds", str(seconds),
         "--burst-s", str(burst_s)],
        capture_output=True, text=True, timeout=seconds + 600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench_provider_budget.py exited with {done.returncode}: "
                           f"{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def bench_provider_budget(ctx: Context) -> list[Figure]:
    shape = QUICK if ctx.quick else FULL
    sessions, rpm, seconds, burst_s = shape
    where = (f"2 drivers, {sessions:,} sessions x 3 turns against a server limited to {rpm} "
             "requests a minute")
    refused = Figure(f"Provider budget: calls refused with 429 ({where})", "%", [],
                     higher_is_better=False, worst_counts=True, goal="<= 1% (issue 30)")
    throughput = Figure(f"Provider budget: calls answered a minute after the first, % of "
                        f"the limit ({where})", "%", [], worst_counts=True,
                        goal=">= 90% of the limit (issue 30)")
    fairness = Figure("Provider budget: the least served 1x tenant, its calls / a fair share "
                      "(one tenant at 10x, nine at 1x)", "x", [], worst_counts=True,
                      goal=">= 0.9 of its fair share (issue 30)")
    for _ in range(1 if ctx.quick else 2):
        result = budget_run_in_child(ctx.bootstrap, shape)
        ctx.log(f"  provider budget: {result}")
        if not result.get("all_waiting"):
            raise RuntimeError(f"a tenant ran out of calls inside the window: {result}")
        refused.ours.append(float(result["refused_pct"]))
        throughput.ours.append(float(result["throughput_pct"]))
        fairness.ours.append(float(result["fair_share_min"]))
    if not ctx.quick:  # the quick run's window holds a few calls per tenant: not judged
        refused.judge(1.0)
        throughput.judge(90.0)
        fairness.judge(0.9)
    note = (f"two `dsh-pipeline driver` children (6 partitions, each holding half of one "
            f"DSH_PROVIDER_LIMITS budget of {rpm} a minute) and the local protocol server "
            "enforcing the same limit (429 + Retry-After, x-ratelimit-* headers); every call "
            "asked at once: ten minutes of the limit. Figures after the budgets' first minute "
            f"(a minute's burst), over [{burst_s} s, {seconds} s], counted from the session "
            "topic (bench/bench_provider_budget.py)")
    refused.note = throughput.note = fairness.note = note
    return [refused, throughput, fairness]
