"""Benchmark: shipping rate (dsh files -> session topic) and replay rate (session topic ->
a rebuilt derived-messages version) on a real local Kafka (not a test; prints figures).

    .venv/bin/python bench/bench_fanout.py [--events 1000000 | --quick] [--sessions 100]
        [--bootstrap HOST:PORT]      # default: start a local single-node broker

Sessions are synthetic (``dsh_dev.synth``: the fixtures' mix, ~87% chunks), written
as packed ``session.jsonl`` files, shipped with 5000-event transactions, then rebuilt.

What the replay figure measures: one ``Rebuilder`` run in this process, from the ``TopicScan``
of the whole session topic (read committed, from offset 0 to the end; the client's records
as they are, ``TopicScan.client_batches``, not copied into InboxRecords) to the last record of
the new version acknowledged (acks=all): wall-clock events/s, and events per CPU-second of
this process (``time.process_time``, all threads; the broker is another process and is not
counted). The rebuild coalesces changes by slot key before writing, so it reports both the
changes folded and the records written. Then the handover's extension is timed with nothing
new to fold (the least the live processors hold for). ``--quick`` (100,000 events) is for a
smoke run: the issue's target (>= 100,000 events/s) is stated for the 1,000,000-event
topic. The load
average is printed before and after each phase: on a shared 2-core machine a wall-clock rate
is only meaningful when it is low.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from dsh_dev.localstack.artifacts import Artifacts
from dsh_dev.localstack.kafka import KafkaLocal
from dsh_dev.synth import synth_header, synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import write_session_file
from pipeline.services.replay.rebuild import Rebuilder
from pipeline.services.replay.ship import Shipper
from pipeline.settings import Settings


def _load() -> float:
    return os.getloadavg()[0]


def write_files(root: Path, events: int, sessions: int) -> int:
    per = events // sessions
    for seed in range(sessions):
        folder = root / f"bench-{seed}"
        folder.mkdir()
        write_session_file(folder / "session.jsonl", synth_session(seed, per),
                           header={**synth_header(seed), "id": f"bench-{seed}"}, packed=True)
    return per * sessions


async def run(settings: Settings, root: Path, total: int) -> None:
    await ensure_topics(settings)
    serde = EventSerde()
    print(f"load average before shipping: {_load():.1f} on {os.cpu_count()} CPUs", flush=True)
    started, cpu = time.monotonic(), time.process_time()
    async with Shipper(settings, root, serde.encode, batch=5000) as shipper:
        await shipper.run()
    ship_s, ship_cpu = time.monotonic() - started, time.process_time() - cpu
    print(f"ship: {total} events in {ship_s:.1f}s = {total / ship_s:,.0f} events/s wall, "
          f"{total / ship_cpu:,.0f} events per CPU-second of this process "
          f"({shipper.stats.transactions} transactions)", flush=True)
    load_before = _load()
    cpu = time.process_time()
    rebuilder = Rebuilder(settings, serde.decode, 1)
    result = await rebuilder.run()
    replay_cpu = time.process_time() - cpu
    print(f"replay: {result.events} events in {result.seconds:.1f}s = "
          f"{result.events / result.seconds:,.0f} events/s wall, "
          f"{result.events / replay_cpu:,.0f} events per CPU-second of this process "
          f"({replay_cpu:.1f} CPU-s; {result.changes} changes folded, "
          f"{result.records_written} records written, {len(result.conversations)} sessions; "
          f"load average {load_before:.1f} before, {_load():.1f} after)", flush=True)
    await bench_hold(rebuilder)


async def bench_hold(rebuilder: Rebuilder) -> None:
    """The handover's extension with nothing new to fold: what the live processors wait
    for at the least (TopicScan re-reads the topic from offset 0)."""
    load_before = _load()
    started, cpu = time.monotonic(), time.process_time()
    await rebuilder.extend()
    print(f"handover extension (hold of the processors, nothing new): "
          f"{time.monotonic() - started:.1f}s wall, {time.process_time() - cpu:.1f} CPU-s "
          f"(load average {load_before:.1f} before, {_load():.1f} after)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=None,
                        help="events to ship and replay (default 1,000,000)")
    parser.add_argument("--quick", action="store_true",
                        help="100,000 events: a smoke run, not the issue's figure")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args()
    events = args.events or (100_000 if args.quick else 1_000_000)
    kafka = None
    if args.bootstrap is None:
        kafka = KafkaLocal(Artifacts.default().require_kafka(), heap_mb=1024)
        kafka.start()
    bootstrap = args.bootstrap or (kafka.bootstrap if kafka else "")
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, partitions=6,
                                 topic_prefix=f"bench{int(time.time())}.")
    try:
        with tempfile.TemporaryDirectory() as folder:
            started = time.monotonic()
            total = write_files(Path(folder), events, args.sessions)
            print(f"wrote {total} events in {time.monotonic() - started:.1f}s", file=sys.stderr)
            asyncio.run(run(settings, Path(folder), total))
    finally:
        if kafka is not None:
            kafka.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
