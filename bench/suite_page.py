"""The suite's session-page benchmark (issue 28): the dashboard's session page ready against
the derived messages of 100 and 10,000 sessions, with the session layout and, for contrast,
the key layout (bench/bench_session_page.py, in a process of its own)."""

from __future__ import annotations

from suite_core import Context, Figure, json_lines_of_child


def page_runs_in_child(bootstrap: str, sizes: list[int], pages: int) -> list[dict[str, float]]:
    return json_lines_of_child("bench_session_page.py", [
        "--bootstrap", bootstrap, "--pages", str(pages), "--sizes", *map(str, sizes)])


def bench_session_page(ctx: Context) -> list[Figure]:
    small, large = 100, ctx.size(10_000, 1_000)
    pages = ctx.size(30, 5)
    note = (f"derived messages of 20 slots per session, 6 partitions; an in-process dashboard "
            f"times {pages} pages from the request of /api/stream/sessions/ID to its "
            "snapshot frame (bench/bench_session_page.py)")
    goals = {"session": "flat: <= 1.25x the 100 sessions figure (issue 28)", "key": ""}
    figures = {layout: Figure(
        f"Session page ready, {large:,} sessions on the derived topic, {layout} layout, p99",
        "ms", [], f"the same with {small} sessions, p99 (same run)", higher_is_better=False,
        worst_counts=True, goal=goals[layout], note=note) for layout in goals}
    for _ in range(ctx.latency_runs if not ctx.quick else 1):
        results = page_runs_in_child(ctx.bootstrap, [small, large], pages)
        for result in results:
            figure = figures[str(result["layout"])]
            if result["sessions"] == large:
                figure.ours.append(result["p99_ms"])
            else:
                figure.anchor_values.append(result["p99_ms"])
            ctx.log(f"  session page: {result}")
    session = figures["session"]
    session.judge(1.25 * (session.anchor_headline or 0.0))
    return list(figures.values())
