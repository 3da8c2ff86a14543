"""The scale-out run of issue 9 as a suite benchmark: its own local 3-node cluster (the
suite's broker is a single node) or ``--cluster``'s, 12 partitions, 2 processors workers,
1/2/3 drivers, then a failover run (kill -9 of one driver and one worker). See
bench/bench_scale_out.py."""

from __future__ import annotations

from typing import Any

import bench_scale_out
from suite_core import Context, Figure

VERIFIED = ("check_ok", "derived_mismatches", "usage_mismatches", "replay_differences")


def bench_scale(ctx: Context) -> list[Figure]:
    """One figure per run (steps/s, wall clock); what the run verified goes in its note.

    A local 3-node cluster of its own, whatever ``--bootstrap`` says (the run needs
    replication 3 with min ISR 2, and counts the brokers' CPU), unless ``--cluster`` gives one
    (the tests' shared cluster: brokers' CPU then not measured).
    """
    figures: list[Figure] = []
    for run in bench_scale_out.bench_scale_out(ctx.cluster or None, ctx.quick, ctx.log):
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
