"""A/B of this checkout against another one (e.g. the commit before a change), same broker.

Runs ``bench/bench_driver_kafka.py`` of each checkout in turn, ``--rounds`` times interleaved
(A, B, A, B, ...), each in a process of its own with that checkout first on ``PYTHONPATH``,
against one Kafka started here (or ``--bootstrap``), and prints each run's JSON line and, per
checkout, the median steps/s and the worst ``visible_ms_p99`` of its rounds, then B/A.

    git worktree add /tmp/base <commit>        # the checkout to compare with
    .venv/bin/python bench/bench_code_ab.py --base /tmp/base [--rounds 3] [--sessions 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from suite_core import kafka_for

HERE = Path(__file__).resolve().parent.parent


def run_checkout(checkout: Path, bootstrap: str, sessions: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(checkout / "bench" / "bench_driver_kafka.py"), "--bootstrap",
         bootstrap, "--sessions", str(sessions)],
        env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True,
        timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (A)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args()
    checkouts = {"A (base)": args.base.resolve(), "B (this checkout)": HERE}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    with kafka_for(args.bootstrap) as bootstrap:
        for _ in range(args.rounds):
            for name, checkout in checkouts.items():
                result = run_checkout(checkout, bootstrap, args.sessions)
                results[name].append(result)
                print(json.dumps({"checkout": name, **result}), flush=True)
    steps = {name: statistics.median(r["steps_per_s"] for r in runs)
             for name, runs in results.items()}
    p99 = {name: max(r["visible_ms_p99"] for r in runs) for name, runs in results.items()}
    a, b = "A (base)", "B (this checkout)"
    print(json.dumps({"steps_per_s_median": steps, "visible_ms_p99_worst": p99,
                      "B/A steps_per_s": steps[b] / steps[a],
                      "B/A visible_ms_p99": p99[b] / p99[a]}), flush=True)


if __name__ == "__main__":
    main()
