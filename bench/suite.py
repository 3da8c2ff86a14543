"""The benchmark suite (issue 8): every figure next to its anchor, measured in the same run.

    .venv/bin/python bench/suite.py [--quick] [--only NAME ...] [--output BENCHMARKS.md]
                                    [--bootstrap HOST:PORT] [--cluster HOST:PORT,...]
                                    [--runs N]
    dsh-pipeline bench ...        (the same)
    make bench

Without ``--bootstrap`` a single-node Kafka is started from the local stack's artifacts for
the run. Kafka's perf tools (``kafka-tools``) are resolved into their own folder on first use;
when they cannot be, the anchors are reported as not measured. ``--quick`` runs every
benchmark briefly (CI, the test): its figures show the suite works, not how fast anything is.
Writes the Markdown report to ``--output`` and prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from suite_approval import bench_approval
from suite_browser import bench_browser
from suite_budget import bench_provider_budget
from suite_core import CHECKOUT, Context, Figure, load_average, wait_quiet
from suite_dashboard import bench_dashboard
from suite_history import bench_history
from suite_idle import bench_idle_cpu
from suite_import import bench_import
from suite_kafka import bench_ingest_consume, bench_replay
from suite_local import bench_avro_codec, bench_fold, bench_memory, bench_processors_state
from suite_mcp import bench_mcp_call
from suite_otel import bench_otel_export
from suite_page import bench_session_page
from suite_report import render
from suite_scale import bench_scale
from suite_secure import bench_restart_time, bench_secure_cost
from suite_services import bench_driver, bench_processors_worker
from suite_tools import tools_lib

Benchmark = Callable[[Context], list[Figure]]
BENCHMARKS: dict[str, tuple[Benchmark, bool]] = {
    # name: (function, needs the broker)
    "avro": (bench_avro_codec, False),
    "fold": (bench_fold, False),
    "memory": (bench_memory, False),
    "state": (bench_processors_state, False),
    "ingest": (bench_ingest_consume, True),
    "processors": (bench_processors_worker, True),
    "driver": (bench_driver, True),
    "replay": (bench_replay, True),
    "otel": (bench_otel_export, True),
    "import": (bench_import, True),
    "dashboard": (bench_dashboard, True),
    "browser": (bench_browser, True),
    "idle": (bench_idle_cpu, True),
    "scaleout": (bench_scale, False),  # starts its own 3-node cluster, or uses --cluster
    "secure": (bench_secure_cost, False),  # starts its own plaintext and secure brokers
    "restart": (bench_restart_time, True),
    "approval": (bench_approval, True),
    "mcp": (bench_mcp_call, True),  # runs server-everything (make mcp-servers)
    "history": (bench_history, True),
    "page": (bench_session_page, True),
    "budget": (bench_provider_budget, True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsh-pipeline bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark, briefly")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME",
                        help=f"run only these: {', '.join(BENCHMARKS)}")
    parser.add_argument("--output", type=Path, default=CHECKOUT / "BENCHMARKS.md")
    parser.add_argument("--bootstrap", default="",
                        help="use this Kafka instead of starting a local one")
    parser.add_argument("--cluster", default="",
                        help="a 3-node cluster for the scale-out benchmark instead of its own")
    parser.add_argument("--runs", type=int, default=0,
                        help="runs per figure (default 3, 1 with --quick)")
    return parser.parse_args(argv)


@contextlib.contextmanager
def broker(bootstrap: str, needed: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The broker's address, and its process ids when the suite starts it."""
    if bootstrap or not needed:
        yield bootstrap, ()
        return
    from dsh_dev.localstack.artifacts import Artifacts
    from dsh_dev.localstack.kafka import KafkaLocal
    kafka = KafkaLocal(Artifacts.default().require_kafka(), heap_mb=1024)
    try:
        kafka.start(budget_s=180)  # a loaded 2-core machine can take well over 60 s
        yield kafka.bootstrap, tuple(kafka.pid(node.node_id) for node in kafka.nodes)
    finally:
        kafka.stop()


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def write_report(args: argparse.Namespace, results: dict[str, list[Figure]],
                 failures: dict[str, str], started: float, load_before: str) -> None:
    command = ("dsh-pipeline bench " + " ".join(args.argv)).replace(f"{CHECKOUT}/", "")
    args.output.write_text(render(results, failures, command=command.strip(),
                                  quick=args.quick, elapsed_s=time.monotonic() - started,
                                  load=(load_before, load_average())))


def run_suite(args: argparse.Namespace) -> tuple[dict[str, list[Figure]], dict[str, str]]:
    """Every benchmark asked for; the report is rewritten after each (a run cut short keeps
    what it measured)."""
    started, load_before = time.monotonic(), load_average()
    names = args.only or list(BENCHMARKS)
    needs_broker = any(BENCHMARKS[name][1] for name in names)
    runs = args.runs or (1 if args.quick else 3)
    results: dict[str, list[Figure]] = {}
    failures: dict[str, str] = {}
    with broker(args.bootstrap, needs_broker) as (bootstrap, pids):
        lib = tools_lib() if needs_broker else None
        ctx = Context(bootstrap, args.quick, runs, lib, log, pids, args.cluster)
        for name in names:
            if BENCHMARKS[name][1] and pids and not args.quick:  # quick figures: not judged
                log(f"{name}: {wait_quiet(pids)}")
            log(f"{name}: start (load average {load_average()})")
            try:
                results[name] = BENCHMARKS[name][0](ctx)
            except Exception as exc:  # one failing benchmark must not lose the others
                failures[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: FAILED\n{traceback.format_exc()}")
            finally:
                pending = {later: "not reached: the run was cut short before it"
                           for later in names[names.index(name) + 1:]}
                write_report(args, results, {**failures, **pending}, started, load_before)
            log(f"{name}: done")
    return results, failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    # aiokafka logs every retried request (leader elections of fresh topics): not figures.
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    started = time.monotonic()
    results, failures = run_suite(args)
    for name, figures in results.items():
        for figure in figures:
            print(json.dumps({"benchmark": name, "figure": figure.name, "unit": figure.unit,
                              "ours": figure.ours, "anchor": figure.anchor,
                              "anchor_values": figure.anchor_values,
                              "e2e_p99": figure.e2e_p99, "run_ratios": figure.run_ratios,
                              "met": figure.met}))
    log(f"wrote {args.output} in {time.monotonic() - started:.0f} s; "
        f"failed: {sorted(failures) or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
