"""Benchmark: the CPU an idle driver and an idle processors worker cost, in % of one core.

Each is started as its own process on fresh topics (nothing to do: an empty inbox and session
topic), left to finish its start-up (the driver's ``ready`` line; the worker's /health), then
its user + system time is read from ``/proc/<pid>/stat`` over ``--seconds`` (30 by default).
The issue 21 target is at most 2% of a core for either.

``--against DIR ...`` measures other checkouts of the code too (e.g. ``git worktree add
/tmp/base main``, or ``git archive <commit> | tar -x -C /tmp/base``), each started from its
own directory with this interpreter, alternating with this checkout in each of ``--rounds``
rounds: an A/B in one run, on the same broker and the same load.

    .venv/bin/python bench/bench_idle.py --bootstrap 127.0.0.1:19092 [--seconds 30]
        [--rounds 3 --against /tmp/base]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from processes import cpu_seconds, stop
from suite_core import load_average

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.settings import Settings

CHECKOUT = Path(__file__).resolve().parent.parent



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def fresh_settings(bootstrap: str) -> Settings:
    prefix = f"idle{uuid.uuid4().hex[:8]}."
    return Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                             partitions=6, replication_factor=1,
                             group_id_prefix=f"{prefix}g-")


def child_env(settings: Settings, state_dir: Path) -> dict[str, str]:
    return {**os.environ, "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "DSH_TOPIC_PREFIX": settings.topic_prefix,
            "DSH_PARTITIONS": str(settings.partitions), "DSH_REPLICATION_FACTOR": "1",
            "DSH_GROUP_ID_PREFIX": settings.group_id_prefix, "DSH_STATE_DIR": str(state_dir)}


def idle_share(argv: list[str], env: dict[str, str], settle_s: float, seconds: float,
               checkout: Path = CHECKOUT) -> float:
    """% of one core the process spends over ``seconds`` once ``settle_s`` have passed
    (the code of ``checkout``: ``-m`` puts its directory first on the module path)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", *argv], cwd=checkout,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle_s)  # start-up, group join, first fetches: not idle yet
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited early ({proc.returncode})")
        before, started = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        used, took = cpu_seconds(proc.pid) - before, time.monotonic() - started
        return 100.0 * used / took
    finally:
        stop(proc)


def measure(bootstrap: str, seconds: float, settle_s: float, checkout: Path = CHECKOUT
            ) -> dict[str, float]:
    settings = fresh_settings(bootstrap)
    asyncio.run(ensure_topics(settings))
    with tempfile.TemporaryDirectory() as state:
        env = child_env(settings, Path(state))
        driver = idle_share(["driver", "--port", str(free_port())], env, settle_s, seconds,
                            checkout)
        worker = idle_share(["processors", "--port", str(free_port()), "--log-level",
                             "warning"], env, settle_s, seconds, checkout)
    return {"driver_idle_pct_core": round(driver, 2), "worker_idle_pct_core": round(worker, 2),
            "seconds": seconds}


def alternate(bootstrap: str, seconds: float, settle_s: float, rounds: int,
              checkouts: list[Path]) -> dict[str, object]:
    """Every checkout once per round, in turn; per checkout each round's figures and their
    median, with the load average before each round."""
    runs: dict[str, list[dict[str, float]]] = {str(c): [] for c in checkouts}
    loads = []
    for _ in range(rounds):
        loads.append(load_average())
        for checkout in checkouts:
            runs[str(checkout)].append(measure(bootstrap, seconds, settle_s, checkout))
    summary: dict[str, object] = {}
    for checkout, measured in runs.items():
        summary[checkout] = {
            key: {"median": round(statistics.median(m[key] for m in measured), 2),
                  "rounds": [m[key] for m in measured]}
            for key in ("driver_idle_pct_core", "worker_idle_pct_core")}
    return {"checkouts": summary, "seconds": seconds, "load_before_rounds": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--against", nargs="*", type=Path, default=[], metavar="CHECKOUT",
                        help="other checkouts measured alternately with this one")
    args = parser.parse_args()
    load = load_average()
    if not args.against and args.rounds == 1:
        result = measure(args.bootstrap, args.seconds, args.settle_s)
        print(json.dumps({**result, "load_average": load}))
        return
    result = alternate(args.bootstrap, args.seconds, args.settle_s, args.rounds,
                       [CHECKOUT, *(path.resolve() for path in args.against)])
    print(json.dumps({**result, "load_before": load, "load_after": load_average()}))


if __name__ == "__main__":
    main()
