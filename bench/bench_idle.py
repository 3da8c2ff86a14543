"""Benchmark: the CPU an idle driver and an idle processors worker cost, in % of one core.

Each is started as its own process on fresh topics (nothing to do: an empty inbox and session
topic), left to finish its start-up (the driver's ``ready`` line; the worker's /health), then
its user + system time is read from ``/proc/<pid>/stat`` over ``--seconds`` (30 by default).
The issue 21 target is at most 2% of a core for either.

    .venv/bin/python bench/bench_idle.py --bootstrap 127.0.0.1:19092 [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from processes import cpu_seconds, stop

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


def idle_share(argv: list[str], env: dict[str, str], settle_s: float, seconds: float
               ) -> float:
    """% of one core the process spends over ``seconds`` once ``settle_s`` have passed."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", *argv], cwd=CHECKOUT,
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


def measure(bootstrap: str, seconds: float, settle_s: float) -> dict[str, float]:
    settings = fresh_settings(bootstrap)
    asyncio.run(ensure_topics(settings))
    with tempfile.TemporaryDirectory() as state:
        env = child_env(settings, Path(state))
        driver = idle_share(["driver", "--port", str(free_port())], env, settle_s, seconds)
        worker = idle_share(["processors", "--port", str(free_port()), "--log-level",
                             "warning"], env, settle_s, seconds)
    return {"driver_idle_pct_core": round(driver, 2), "worker_idle_pct_core": round(worker, 2),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=20.0)
    args = parser.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    result = measure(args.bootstrap, args.seconds, args.settle_s)
    print(json.dumps({**result, "load_average": load}))


if __name__ == "__main__":
    main()
