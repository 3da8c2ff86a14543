"""A partition moved after ``kill -9`` (issue 28): kill -> the first event its new owner writes.

Each run starts two ``dsh-pipeline driver`` processes in one group on fresh topics (6
partitions), keeps 60 sessions busy (queued follow-ups, a slow scripted model), waits until
both own partitions and every session has committed events, then kills one with SIGKILL. For
each partition the dead driver owned, the figure is the time from the kill to the first
committed record on it written after the kill (its record timestamp, the producer's clock,
is after the kill: the dead driver's last records were created before it). What bounds it:
the group session timeout (detection), the rejoin (one heartbeat interval), and the
takeover (fence, read the checkpoints, repair the open turns).

Prints one JSON line per run: ``{"samples_ms": [...], "session_timeout_ms"}``, then a summary
line ``{"p99_ms", "p50_ms", "worst_ms", "samples"}``.

Usage: .venv/bin/python bench/bench_driver_move.py [--runs 5] [--session-timeout-ms 3000]
       [--bootstrap HOST:PORT]   (default: start a local single-node Kafka)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

from aiokafka import AIOKafkaConsumer
from suite_core import kafka_for

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.inbox import InboxCodec
from pipeline.core.inbox import FollowUp
from pipeline.settings import Settings

PARTITIONS = 6
SESSIONS = 60
FOLLOW_UPS = 40  # queued per session: every partition stays busy past the kill


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class DriverProcess:
    def __init__(self, settings: Settings, session_timeout_ms: int) -> None:
        self.port = _free_port()
        env = {**os.environ, "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
               "DSH_TOPIC_PREFIX": settings.topic_prefix, "DSH_PARTITIONS": str(PARTITIONS),
               "DSH_GROUP_ID_PREFIX": settings.group_id_prefix}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli.main", "driver", "--metrics-port",
             str(self.port), "--session-timeout-ms", str(session_timeout_ms),
             "--script-chunk-delay-ms", "40"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def owned(self) -> list[int]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                        timeout=2) as answer:
                body = json.loads(answer.read())
        except OSError:
            return []
        partitions: list[int] = body.get("partitions", []) if body.get("ready") else []
        return partitions

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def keep_busy(settings: Settings) -> None:
    codec = InboxCodec()
    records = [OutRecord(settings.topics.inbox, f"busy-{n}".encode(), codec.encode(FollowUp(
        f"busy-{n}", str(uuid.uuid4()), ({"type": "text", "text": f"turn {k} " * 30},))))
        for k in range(FOLLOW_UPS) for n in range(SESSIONS)]
    await send_records(settings, records)


async def first_records_after(settings: Settings, partitions: list[int], killed_ms: int,
                              timeout_s: float = 60) -> dict[int, int]:
    """The timestamp (ms) of the first committed record after ``killed_ms`` per partition."""
    tail = AIOKafkaConsumer(settings.topics.session_events, **client_options(settings),
                            group_id=None, isolation_level="read_committed",
                            auto_offset_reset="earliest")
    await tail.start()
    found: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while set(found) != set(partitions) and time.monotonic() < deadline:
            for tp, records in (await tail.getmany(timeout_ms=200)).items():
                for record in records:
                    if tp.partition in partitions and record.timestamp > killed_ms:
                        found.setdefault(tp.partition, record.timestamp)
    finally:
        await tail.stop()
    return found


def one_run(bootstrap: str, session_timeout_ms: int) -> list[float]:
    prefix = f"mv{uuid.uuid4().hex[:8]}."
    settings = Settings(bootstrap_servers=bootstrap, topic_prefix=prefix,
                        partitions=PARTITIONS, group_id_prefix=f"{prefix}g-")
    asyncio.run(ensure_topics(settings))
    drivers = [DriverProcess(settings, session_timeout_ms) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while sorted(drivers[0].owned() + drivers[1].owned()) != list(range(PARTITIONS)) \
                or not drivers[0].owned() or not drivers[1].owned():
            if time.monotonic() > deadline:
                raise RuntimeError("the two drivers never split the partitions")
            time.sleep(0.2)
        asyncio.run(keep_busy(settings))
        time.sleep(3)  # every session mid-turn, each partition committing
        victim = drivers[0]
        lost = victim.owned()
        killed_ms = int(time.time() * 1000)
        victim.process.kill()
        firsts = asyncio.run(first_records_after(settings, lost, killed_ms))
        if set(firsts) != set(lost):
            raise RuntimeError(f"partitions {sorted(set(lost) - set(firsts))} never moved")
        return [float(firsts[p] - killed_ms) for p in lost]
    finally:
        for driver in drivers:
            driver.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--session-timeout-ms", type=int, default=3000)
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args()
    samples: list[float] = []
    with kafka_for(args.bootstrap) as bootstrap:
        for _ in range(args.runs):
            run = one_run(bootstrap, args.session_timeout_ms)
            samples += run
            print(json.dumps({"samples_ms": run,
                              "session_timeout_ms": args.session_timeout_ms}), flush=True)
    ordered = sorted(samples)
    print(json.dumps({"p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                      "p50_ms": ordered[len(ordered) // 2], "worst_ms": ordered[-1],
                      "samples": len(ordered)}), flush=True)


if __name__ == "__main__":
    main()
