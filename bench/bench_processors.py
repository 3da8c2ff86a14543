"""Processors worker: sustained events/s and append -> derived-change latency (issue 5).

Usage: .venv/bin/python bench/bench_processors.py [--events 60000] [--rate 5000]
       [--bootstrap HOST:PORT]   (default: start a local single-node Kafka for the run)

Throughput. Generated sessions (turns, steps, tool calls, replaces, usage; ~70% of events are
``assistant/chunk``, as in real logs) are published to a fresh session topic first; then one
``dsh-pipeline processors`` worker (memory store, 3 partitions) starts and the figure is the
records it handled per second of wall time between its first and its last record (polled on
``GET /health``, so +-0.2 s), tables, changelogs, outputs and per-model stage included.

Latency. With the worker caught up, sessions are appended at ``--rate`` events/s (paced by
wall clock, a fresh producer); for every surface event, the latency is the CreateTime of its
derived-messages record (stamped by the worker's producer when it sends the change) minus the
CreateTime of the session event. p50/p99/max over all surface events. Both stamps come from
this machine's clock.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from processors_support import Worker, event_records, free_port, generated_sessions

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.core.events import Event
from pipeline.settings import Settings


def make_sessions(seed: int, events: int, prefix: str) -> dict[str, list[Event]]:
    count = max(1, events // 260)
    return generated_sessions(seed, count, prefix, ["m1", "m2"], int(time.time() * 1000),
                              max_chunks=60)


async def publish(settings: Settings, sessions: dict[str, list[Event]]) -> int:
    records = [r for sid, events in sessions.items()
               for r in event_records(settings, sid, events)]
    for start in range(0, len(records), 5000):
        await send_records(settings, records[start:start + 5000])
    return len(records)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    import os
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(worker: Worker, total: int) -> tuple[float, float, float]:
    """(records per wall second, wall seconds, records per worker CPU second)."""
    first: tuple[float, int, float] | None = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        handled = worker.get("/health")[1]["counters"]["records"]
        now, cpu = time.monotonic(), cpu_seconds(worker.proc.pid)
        if first is None and handled > 0:
            first = (now, handled, cpu)
        if handled >= total and first is not None:
            done = handled - first[1]
            return (done / max(now - first[0], 1e-9), now - first[0],
                    done / max(cpu - first[2], 1e-9))
        time.sleep(0.2)
    raise SystemExit(f"worker did not finish: {worker.tail()}")


async def paced_append(settings: Settings, sessions: dict[str, list[Event]], rate: float
                       ) -> dict[tuple[str, int], float]:
    """Append interleaved sessions at ``rate`` events/s; returns send time of surface events."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, linger_ms=1)
    await producer.start()
    queues = [event_records(settings, sid, events) for sid, events in sessions.items()]
    order = [(sid, e) for sid, events in sessions.items() for e in events]
    by_session = {sid: iter(q) for sid, q in zip(sessions, queues, strict=True)}
    sent: dict[tuple[str, int], float] = {}
    began = time.monotonic()
    interleaved = sorted(order, key=lambda item: (item[1].seq, item[0]))
    try:
        for index, (sid, event) in enumerate(interleaved):
            wait = began + index / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            record = next(by_session[sid])
            stamp = int(time.time() * 1000)
            await producer.send(record.topic, record.value, key=record.key,
                                headers=list(record.headers), timestamp_ms=stamp)
            if event.surface_op is not None:
                sent[(sid, event.seq)] = stamp
        await producer.flush()
    finally:
        await producer.stop()
    return sent


async def derived_stamps(settings: Settings, wanted: dict[tuple[str, int], float]
                         ) -> list[float]:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    topic = settings.topics.derived_messages
    parts = [TopicPartition(topic, p) for p in range(settings.partitions)]
    consumer.assign(parts)
    latencies: list[float] = []
    deadline = time.monotonic() + 120
    try:
        import json
        while len(latencies) < len(wanted) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    if r.value is None:
                        continue
                    value: Any = json.loads(r.value)
                    key = (value["session"], value["changeSeq"])
                    if key in wanted and value["seq"] == value["changeSeq"]:
                        latencies.append(r.timestamp - wanted[key])
    finally:
        await consumer.stop()
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(bootstrap: str, events: int, rate: float) -> None:
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=3, group_id_prefix=f"{prefix}g-")
    asyncio.run(ensure_topics(settings))
    sessions = make_sessions(1, events, "tp")
    total = asyncio.run(publish(settings, sessions))
    chunks = sum(1 for es in sessions.values() for e in es if e.type == "assistant/chunk")
    print(f"published {total} events ({chunks / total:.0%} chunks) in {len(sessions)} sessions")
    print(f"load average before the run: {Path('/proc/loadavg').read_text().split()[:3]}")
    with tempfile.TemporaryDirectory() as state:
        worker = Worker(settings, free_port(), Path(state), ["--loglevel", "WARNING"])
        try:
            worker.wait_ready()
            per_s, took, per_cpu_s = throughput(worker, total)
            print(f"throughput: {per_s:,.0f} events/s wall ({total} events in {took:.1f} s); "
                  f"{per_cpu_s:,.0f} events per worker CPU-second")
            live = make_sessions(2, max(1500, int(rate * 10)), "lat")
            sent = asyncio.run(paced_append(settings, live, rate))
            lat = asyncio.run(derived_stamps(settings, sent))
            print(f"latency at {rate:.0f} events/s over {len(lat)} surface events: "
                  f"p50 {percentile(lat, 0.5):.0f} ms, p99 {percentile(lat, 0.99):.0f} ms, "
                  f"max {max(lat):.0f} ms")
        finally:
            worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--rate", type=float, default=5_000)
    parser.add_argument("--bootstrap", default="")
    args = parser.parse_args()
    if args.bootstrap:
        run(args.bootstrap, args.events, args.rate)
        return
    from pipeline.adapters.localstack.artifacts import Artifacts
    from pipeline.adapters.localstack.kafka import KafkaLocal
    with KafkaLocal(Artifacts.default().require_kafka()) as kafka:
        run(kafka.bootstrap, args.events, args.rate)


if __name__ == "__main__":
    main()
