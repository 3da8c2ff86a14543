"""The OTLP export benchmark of the suite: ``dsh-pipeline otel``'s events per CPU-second,
anchored on a processors worker's on the same backlog in the same run (bench_otel.py, which
stays runnable on its own)."""

from __future__ import annotations

import bench_otel
from suite_core import Context, Figure


def bench_otel_export(ctx: Context) -> list[Figure]:
    events = ctx.size(200_000, 40_000)
    note = ("generated sessions (~80% chunks), 3 partitions; the otel process decodes the span "
            "types only (chunks skipped by header), exports every ended turn to a local "
            "OTLP/HTTP receiver and waits for its ack; user + system time of each process "
            "(/proc); the two run one after the other (bench/bench_otel.py)")
    per_cpu = Figure("OTLP export: events per otel CPU-second", "events/CPU-s", [],
                     "processors worker on the same backlog, same run", note=note)
    wall = Figure("OTLP export: events/s, one otel process (backlog of a fresh topic)",
                  "events/s", [], "processors worker on the same backlog, same run")
    for run in range(ctx.runs):
        ctx.log(f"otel run {run + 1}: {events} events")
        found = bench_otel.run(ctx.bootstrap, events)
        per_cpu.ours.append(found["otel_events_per_cpu_s"])
        per_cpu.anchor_values.append(found["processors_events_per_cpu_s"])
        wall.ours.append(found["otel_events_per_s"])
        wall.anchor_values.append(found["processors_events_per_s"])
    return [per_cpu, wall]
