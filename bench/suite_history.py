"""The suite's driver-history benchmark (issue 28): start, memory and wake-up against the
history on the session topic (bench/bench_driver_history.py, in a process of its own)."""

from __future__ import annotations

from suite_core import Context, Figure, json_lines_of_child


def history_runs_in_child(bootstrap: str, sizes: list[int], wakeups: int, active: int
                          ) -> list[dict[str, float]]:
    return json_lines_of_child("bench_driver_history.py", [
        "--bootstrap", bootstrap, "--wakeups", str(wakeups), "--active", str(active),
        "--sizes", *map(str, sizes)])


def bench_history(ctx: Context) -> list[Figure]:
    sizes = [100_000, 1_000_000] if not ctx.quick else [10_000]
    wakeups = ctx.size(100, 10)
    active = ctx.size(1000, 100)
    note = ("sessions of ~1,000 events of the driver's own turns (scripted model), 6 "
            "partitions; a fresh `dsh-pipeline driver` process after a first one migrated the "
            "topic (bench/bench_driver_history.py)")
    start = {n: Figure(f"Driver start -> first turn of a new session ended, {n:,} events of "
                       "history", "s", [], higher_is_better=False, worst_counts=True,
                       goal="<= 1.5x the smallest history's (issue 28)" if n != sizes[0]
                       else "", note=note) for n in sizes}
    rss = {n: Figure(f"Driver RSS, {n:,} events of history, {active:,} sessions active", "MiB",
                     [],
                     higher_is_better=False, worst_counts=True,
                     goal="<= 1.2x the smallest history's (issue 28)" if n != sizes[0]
                     else "") for n in sizes}
    wake = Figure("Wake-up of an evicted session: command -> its first event readable, p99",
                  "ms", [], "the same path for a session in memory, p99 (same run)",
                  higher_is_better=False, worst_counts=True, goal="<= 200 ms (issue 28)",
                  note="one command at a time, sessions never loaded by this driver (each "
                       "one's checkpoint read at its offset)")
    for _ in range(ctx.latency_runs if not ctx.quick else 1):
        for result in history_runs_in_child(ctx.bootstrap, sizes, wakeups, active):
            size = sizes[min(range(len(sizes)), key=lambda i: abs(sizes[i] - result["events"]))]
            start[size].ours.append(result["start_to_turn_s"])
            rss[size].ours.append(result["rss_mib"])
            if size == sizes[0]:
                wake.ours.append(result["wake_p99_ms"])
                wake.anchor_values.append(result["anchor_p99_ms"])
            ctx.log(f"  history: {result}")
    base_start, base_rss = start[sizes[0]].headline, rss[sizes[0]].headline
    for size in sizes[1:]:
        start[size].judge(1.5 * base_start)
        rss[size].judge(1.2 * base_rss)
    wake.judge(200.0)
    return [*start.values(), *rss.values(), wake]
