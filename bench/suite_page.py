"""The suite's session-page benchmark (issue 28): the dashboard's session page ready with 100
and 10,000 sessions, started from a processors worker's tables and, for contrast, from the
derived-messages topic in the session and the key layout (bench/bench_session_page.py, in a
process of its own)."""

from __future__ import annotations

from suite_core import Context, Figure, json_lines_of_child


def page_runs_in_child(bootstrap: str, sizes: list[int], pages: int, layouts: list[str]
                       ) -> list[dict[str, float]]:
    return json_lines_of_child("bench_session_page.py", [
        "--bootstrap", bootstrap, "--pages", str(pages), "--sizes", *map(str, sizes),
        "--layouts", *layouts])


def bench_session_page(ctx: Context) -> list[Figure]:
    small, large = 100, ctx.size(10_000, 500)
    pages = ctx.size(30, 5)
    note = (f"6 partitions; an in-process dashboard times {pages} pages from the request of "
            "/api/stream/sessions/ID until it has caught up with the session topic (its "
            "caught-up frame: the snapshot shown and live); processors: sessions of 60 "
            "synthetic events folded by a processors worker, pages started from its tables; "
            "session/key: derived records of 20 slots per session in that layout, read by "
            "the page (bench/bench_session_page.py)")
    goals = {"processors": "flat: <= 1.25x the 100 sessions figure (issue 28)",
             "session": "", "key": ""}
    if ctx.quick:   # the goal's figure only: the derived-topic contrast is for full runs
        goals = {"processors": goals["processors"]}
    figures = {layout: Figure(
        f"Session page ready (caught up), {large:,} sessions, {layout} "
        f"{'tables' if layout == 'processors' else 'layout'}, p99",
        "ms", [], f"the same with {small} sessions, p99 (same run)", higher_is_better=False,
        worst_counts=True, goal=goals[layout], note=note) for layout in goals}
    for _ in range(ctx.latency_runs if not ctx.quick else 1):
        results = page_runs_in_child(ctx.bootstrap, [small, large], pages, list(goals))
        for result in results:
            figure = figures[str(result["layout"])]
            if result["sessions"] == large:
                figure.ours.append(result["ready_p99_ms"])
            else:
                figure.anchor_values.append(result["ready_p99_ms"])
            ctx.log(f"  session page: {result}")
    flat = figures["processors"]
    flat.judge(1.25 * (flat.anchor_headline or 0.0))
    return list(figures.values())
