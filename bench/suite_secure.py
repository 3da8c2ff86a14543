"""The benchmarks of issue 16 in the suite: the secure stack's throughput against plaintext
(bench_secure.py: both brokers started by it, rounds alternating), and the processors' restart
time with history, rocksdb:// against memory:// (bench_restart.py, on the suite's broker).
Both stay runnable on their own."""

from __future__ import annotations

import tempfile
from pathlib import Path

import bench_restart
import bench_secure
from suite_core import Context, Figure


def bench_secure_cost(ctx: Context) -> list[Figure]:
    events = ctx.size(100_000, 5_000)
    note = ("two single-node brokers side by side, plaintext and secure (TLS + SCRAM-SHA-512 + "
            "ACLs, the configuration of `broker --secure`), rounds alternating; generated "
            "sessions (~80% chunks), 3 partitions; ingest = send_records as the ingest "
            "principal, processors = one memory:// worker folding that backlog "
            "(bench/bench_secure.py)")
    ingest = Figure("secure stack: ingest events/s (TLS + SCRAM + ACLs)", "events/s", [],
                    "the same on a plaintext broker, same run", goal=">= 0.7x plaintext",
                    note=note)
    fold = Figure("secure stack: processors records/s (TLS + SCRAM + ACLs)", "records/s", [],
                  "the same on a plaintext broker, same run", goal=">= 0.7x plaintext")
    rounds = ctx.runs if ctx.quick else max(ctx.runs, 2)  # quick: one of each, no figure
    with tempfile.TemporaryDirectory(prefix="dsh-bench-secure-") as tmp:
        found = bench_secure.run(events, rounds, Path(tmp), ctx.log)
    ingest.ours, ingest.anchor_values = found["secure_ingest"], found["plain_ingest"]
    fold.ours, fold.anchor_values = found["secure_fold"], found["plain_fold"]
    return [ingest, fold]


def bench_restart_time(ctx: Context) -> list[Figure]:
    events = ctx.size(1_000_000, 10_000)
    figure = Figure(f"processors restart to ready with ~{events:,} records of history, "
                    "rocksdb://", "s", [], "memory:// (restores every changelog), same run",
                    higher_is_better=False, goal="rocksdb:// >= 5x faster (ratio <= 0.2)",
                    note="one worker folds the history and stops cleanly (SIGTERM); a second "
                         "with the same data folder is timed from launch to /health ready "
                         "(partitions assigned, no recovery left) (bench/bench_restart.py)")
    with tempfile.TemporaryDirectory(prefix="dsh-bench-restart-") as tmp:
        for run in range(ctx.runs):
            for store in ("memory://", "rocksdb://"):
                history, seconds = bench_restart.restart_seconds(
                    ctx.bootstrap, store, events, Path(tmp) / f"run{run}")
                (figure.anchor_values if store == "memory://" else figure.ours).append(seconds)
                ctx.log(f"restart run {run + 1}, {store}: {seconds:.1f} s with {history:,} "
                        "records of history")
    return [figure]
