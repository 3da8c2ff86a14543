"""Benchmark: the scale-out run of issue 9 on a local 3-broker cluster.

Starts the local 3-node KRaft cluster (replication 3, min ISR 2) unless ``--bootstrap`` is
given, then runs, each on fresh topics (12 partitions) with 2 processors workers and the
scripted provider (a two-step tool turn per session), as real child processes:

* 1, 2 and 3 ``dsh-pipeline driver`` processes, nothing killed: throughput;
* 3 drivers, with SIGKILL of driver 1 and worker 1 once 30% of the turns have ended: the
  sessions move, every turn still ends, and the verification must still pass.

Every run then checks the whole topic (``check``: every log valid, seq contiguous, no open
turn, every call answered), the surviving worker's tables against core's folds, and the
workers' derived-messages topic against a replay (:mod:`scale_out_verify`). Figures per run:
``steps_per_s`` / ``events_per_s`` (wall clock, first inbox send to the last turn's end seen
read_committed), CPU seconds of the drivers, workers and brokers over that span, sessions and
partitions moved, takeover times, and the load average before -> after.

    .venv/bin/python bench/bench_scale_out.py            # full: 700 / 2,000 sessions
    .venv/bin/python bench/bench_scale_out.py --quick    # one failover run, 60 sessions

The suite calls :func:`bench_scale_out` (``bootstrap=None`` starts the 3-node cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from scale_out_support import ScaleOutPlan, local_cluster, run_scale_out

FULL_SESSIONS = 2000        # the failover run: "a few thousand sessions" (issue 9)
THROUGHPUT_SESSIONS = 700   # each 1/2/3-driver run: enough for a steady rate, and the
QUICK_SESSIONS = 60         # full suite stays within its 15 minutes (issue 8)


def plans(quick: bool, sessions: int | None = None) -> list[tuple[str, ScaleOutPlan]]:
    """(label, plan) of every run: quick mode is the failover run alone, small."""
    if quick:
        size = sessions or QUICK_SESSIONS
        return [("3 drivers, kill -9 of driver 1 and worker 1",
                 ScaleOutPlan(drivers=3, sessions=size, kill_at=0.3,
                              driver_session_timeout_ms=6000, worker_session_timeout_s=6.0))]
    runs = [(f"{n} driver{'s' if n > 1 else ''}, nothing killed",
             ScaleOutPlan(drivers=n, sessions=sessions or THROUGHPUT_SESSIONS, kill_at=None,
                          timeout_s=600.0))
            for n in (1, 2, 3)]
    runs.append(("3 drivers, kill -9 of driver 1 and worker 1",
                 ScaleOutPlan(drivers=3, sessions=sessions or FULL_SESSIONS, kill_at=0.3,
                              timeout_s=600.0)))
    return runs


@contextlib.contextmanager
def _cluster(bootstrap: str | None, log: Callable[[str], None]
             ) -> Iterator[tuple[str, list[int]]]:
    """(bootstrap, broker pids): the given cluster (pids unknown), or a local 3-node one."""
    if bootstrap:
        yield bootstrap, []
        return
    with local_cluster(log) as kafka:
        yield kafka.bootstrap, [kafka.pid(node.node_id) for node in kafka.nodes]


def bench_scale_out(bootstrap: str | None, quick: bool, log: Callable[[str], None],
                    sessions: int | None = None, workdir: Path | None = None
                    ) -> list[dict[str, Any]]:
    """Every run of :func:`plans` on one cluster; one dict of figures per run, labelled.

    ``workdir``: where the processes' logs stay (default: a temporary folder, removed).
    ``bootstrap`` None starts the local 3-node cluster (and stops it afterwards); a given
    cluster gets replication factor min(3, its brokers). Raises AssertionError when a run
    does not finish or a fleet process dies on its own; verification failures are figures
    (``check_ok``, ``derived_mismatches``, ``replay_differences``...), never hidden.
    """
    results: list[dict[str, Any]] = []
    with _cluster(bootstrap, log) as (servers, broker_pids), \
            tempfile.TemporaryDirectory(prefix="dsh-scale-out-") as tmp:
        for number, (label, plan) in enumerate(plans(quick, sessions), start=1):
            log(f"run {number}: {label}, {plan.sessions} sessions x {plan.turns} turn(s), "
                f"{plan.partitions} partitions, {plan.workers} workers")
            logs = (workdir or Path(tmp)) / f"run-{number}"
            figures = asyncio.run(run_scale_out(servers, plan, logs, log, broker_pids))
            results.append({"run": label, **figures})
            log(json.dumps(results[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small failover run")
    parser.add_argument("--sessions", type=int, help="sessions per run (default: "
                        f"{THROUGHPUT_SESSIONS} per throughput run, {FULL_SESSIONS} for the "
                        f"failover run; --quick {QUICK_SESSIONS})")
    parser.add_argument("--bootstrap", help="use this cluster instead of starting 3 nodes")
    parser.add_argument("--workdir", type=Path,
                        help="keep the processes' logs here (default: a temporary folder)")
    args = parser.parse_args()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    for result in bench_scale_out(args.bootstrap, args.quick, log, args.sessions,
                                  args.workdir):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
