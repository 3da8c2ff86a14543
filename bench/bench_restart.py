"""Processors restart time with history: ``rocksdb://`` against ``memory://`` (issue 16;
target: RocksDB >= 5x faster, since it keeps the tables across a clean restart).

Usage: .venv/bin/python bench/bench_restart.py [--events 100000] [--bootstrap HOST:PORT]
       (default: start a local single-node Kafka)

For each store, on a fresh topic prefix: generated sessions (as bench_processors) are published,
one worker folds them and is stopped with SIGTERM (a clean stop), then a second worker is
started with the same data folder; the figure is the wall time from its start until its
``/health`` shows its partitions assigned and no recovery left (the tables restored: from the
whole changelogs on memory://, from the local store plus each changelog's tail on rocksdb://).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from processors_support import Worker, event_records, free_port, generated_sessions

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.cli.local_store import CLEAN_STOP_MARKER
from pipeline.settings import Settings

PARTITIONS = 3
STOP_BUDGET_S = 300


def _settings(bootstrap: str, tag: str) -> Settings:
    prefix = f"r{tag}{os.getpid()}{int(time.time()) % 100000}."
    return Settings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=PARTITIONS,
                    group_id_prefix=f"{prefix}g-")


def _records(worker: Worker) -> int:
    return int(worker.get("/health")[1]["counters"]["records"])


def _ready(worker: Worker) -> bool:
    status, body = worker.get("/health")
    return status == 200 and not body["recovery"]["in_recovery"] and bool(body["partitions"])


def restart_seconds(bootstrap: str, store: str, events: int, folder: Path
                    ) -> tuple[int, float]:
    """(records of history, seconds from the restart to ready)."""
    settings = _settings(bootstrap, store[:3])
    asyncio.run(ensure_topics(settings))
    # ~185 records per generated session (seed 11, up to 60 chunks per message)
    sessions = generated_sessions(11, max(1, events // 185), "rs", ["m1", "m2"],
                                  int(time.time() * 1000), max_chunks=60)
    records = [r for sid, evs in sessions.items() for r in event_records(settings, sid, evs)]
    for start in range(0, len(records), 5000):
        asyncio.run(send_records(settings, records[start:start + 5000]))
    data = folder / f"data-{store[:3]}"
    extra = ["--store", store, "--data-dir", str(data)]
    first = Worker(settings, free_port(), folder, extra)
    try:
        first.wait_for("the first worker ready", lambda: _ready(first), 900)
        first.wait_for("the history folded", lambda: _records(first) >= len(records), 900)
        time.sleep(3)  # one commit interval: tables written, offsets committed
        first.proc.send_signal(signal.SIGTERM)
        first.proc.wait(STOP_BUDGET_S)   # a loaded machine's clean stop can take a while
    finally:
        first.stop()
    if first.proc.returncode != 0 or (
            store == "rocksdb://" and not (data / CLEAN_STOP_MARKER).is_file()):
        raise SystemExit(f"the first worker did not stop cleanly ({first.proc.returncode}): "
                         f"the restart would not be a clean one; see {first.log_path}")
    began = time.monotonic()
    second = Worker(settings, free_port(), folder, extra)
    try:
        second.wait_for("the restarted worker ready", lambda: _ready(second), 900)
        return len(records), time.monotonic() - began
    finally:
        second.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsh-bench-restart-") as tmp:
        kafka = None if args.bootstrap else KafkaLocal(Artifacts.default().require_kafka(),
                                                       Path(tmp) / "kafka")
        if kafka is not None:
            kafka.start(300)
        bootstrap = args.bootstrap or (kafka.bootstrap if kafka else "")
        try:
            figures = {}
            for store in ("memory://", "rocksdb://"):
                load = os.getloadavg()[0]
                history, seconds = restart_seconds(bootstrap, store, args.events, Path(tmp))
                figures[store] = seconds
                print(f"{store}: restart to ready {seconds:.1f} s with {history:,} records of "
                      f"history (load {load:.1f})", flush=True)
            print(f"rocksdb:// restarts {figures['memory://'] / figures['rocksdb://']:.1f}x "
                  "faster (target >= 5x)", flush=True)
        finally:
            if kafka is not None:
                kafka.stop()


if __name__ == "__main__":
    main()
