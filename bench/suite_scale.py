"""The scale-out run of issue 9 as a suite benchmark: its own local 3-node cluster (the
suite's broker is a single node), 12 partitions, 2 processors workers, 1/2/3 drivers, then a
failover run (kill -9 of one driver and one worker). See bench/bench_scale_out.py."""

from __future__ import annotations

from typing import Any

import bench_scale_out
from suite_core import Context, Figure

VERIFIED = ("check_ok", "derived_mismatches", "usage_mismatches", "replay_differences")


def bench_scale(ctx: Context) -> list[Figure]:
    """One figure per run (steps/s, wall clock); what the run verified goes in its note.

    Always a local 3-node cluster, whatever ``--bootstrap`` says: the run kills and counts
    brokers' CPU, and needs replication 3 with min ISR 2.
    """
    figures: list[Figure] = []
    for run in bench_scale_out.bench_scale_out(None, ctx.quick, ctx.log):
        figure = Figure(f"Scale-out: steps/s, {run['run']}", "steps/s", [float(run["steps_per_s"])],
                        note=_note(run))
        figures.append(figure)
    return figures


def _note(run: dict[str, Any]) -> str:
    verified = ", ".join(f"{key}={run.get(key)}" for key in VERIFIED if key in run)
    moved = (f"; killed {run['killed']}: {run['partitions_moved']} partitions and "
             f"{run['sessions_moved']} sessions moved, {run['turns_repaired']} turns repaired"
             if run.get("killed") else "")
    return (f"{run['sessions']:,} sessions, {run['events']:,} events in {run['elapsed_s']} s "
            f"({run['events_per_s']:,} events/s), {run['drivers']} drivers, {run['workers']} "
            f"workers, {run['partitions']} partitions, one run{moved}; verified: {verified}")
