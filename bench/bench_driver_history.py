"""The driver bounded by live state (issue 28): start time, memory and wake-up against history.

For each history size (events on the session topic, in sessions of about 1,000 events each,
the driver's own turns, cloned under new ids): publish it on fresh topics, let a first
``dsh-pipeline driver`` migrate it (the one full read; timed until it is ready: every
partition built), stop it, then:

- **start to first turn**: spawn a fresh ``dsh-pipeline driver`` process and, at once, send a
  follow-up to a new session; the figure is the wall time from the spawn until that session's
  ``turn/end`` is readable (read committed);
- **RSS with 1,000 sessions active** (``--active``): then a follow-up to 1,000 new sessions;
  the driver's VmRSS once all their turns ended;
- **wake-up** (``--wakeups N``): command -> first event of the session readable, for N old
  sessions (never loaded by this driver: each one's checkpoint read at its offset), one at a
  time, against the anchor of the same path for sessions in memory, in the same run.

Prints one JSON line per size:
``{"events", "migrate_s", "start_to_turn_s", "rss_mib", "wake_p99_ms", "wake_p50_ms",
"anchor_p99_ms", "anchor_p50_ms", "session_records_read"}``.

Usage: .venv/bin/python bench/bench_driver_history.py [--sizes 100000 1000000]
       [--wakeups 100] [--active 1000] [--bootstrap HOST:PORT]
       (default: start a local single-node Kafka)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from suite_core import kafka_for

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.adapters.llm.scripted import ScriptedProvider, echo_script
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import event_headers
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

PARTITIONS = 6
SESSION_EVENTS = 1000
SERDE = EventSerde()


def _settings(bootstrap: str) -> Settings:
    prefix = f"h{uuid.uuid4().hex[:8]}."
    return Settings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=PARTITIONS,
                    group_id_prefix=f"{prefix}g-")


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    return {**os.environ, "DSH_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "DSH_TOPIC_PREFIX": settings.topic_prefix, "DSH_PARTITIONS": str(PARTITIONS),
            "DSH_GROUP_ID_PREFIX": settings.group_id_prefix, **extra}


async def template_log() -> list[Event]:
    """One session of about SESSION_EVENTS events, as the driver's turn logic writes it."""
    driver = Driver(provider_factory=lambda _p, _m: ScriptedProvider(echo_script),
                    tools=builtin_registry(), config=SessionConfig("scripted", "scripted-1"))
    turn = 0
    assert isinstance(driver.sink, MemorySink)
    while len(driver.sink.events.get("t", [])) < SESSION_EVENTS:
        driver.submit(FollowUp("t", f"m{turn}", ({"type": "text", "text": f"turn {turn}"},)))
        await driver.drain()
        turn += 1
    return driver.sink.events["t"]


async def publish_history(settings: Settings, events: int) -> list[str]:
    """``events`` of history in sessions cloned from one log; their session ids."""
    log = await template_log()
    sessions = [f"old-{n}" for n in range(max(1, events // len(log)))]
    topic = settings.topics.session_events
    headers = [list(event_headers(e)) for e in log]
    async with BulkProducer(settings) as producer:
        for session in sessions:
            await producer.send_many(topic, [(session.encode(), SERDE.encode(session, e), h)
                                             for e, h in zip(log, headers, strict=True)])
    return sessions


class Driven:
    """A ``dsh-pipeline driver`` process and a read-committed tail of the session topic."""

    def __init__(self, settings: Settings, **env: str) -> None:
        self.settings = settings
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli.main", "driver", "--metrics-port", "-1"],
            env=_env(settings, **env), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.tail: AIOKafkaConsumer | None = None
        self.first: dict[str, float] = {}
        self.turn_ends: dict[str, float] = {}

    async def start_tail(self) -> None:
        self.tail = AIOKafkaConsumer(self.settings.topics.session_events,
                                     **client_options(self.settings), group_id=None,
                                     isolation_level="read_committed",
                                     auto_offset_reset="latest")
        await self.tail.start()
        await self.tail.seek_to_end()

    async def wait(self, done: set[str], kind: str, timeout_s: float = 300) -> None:
        """Read the tail until every session of ``done`` has a first event / a turn end."""
        assert self.tail is not None
        seen = self.first if kind == "first" else self.turn_ends
        deadline = time.monotonic() + timeout_s
        while not done <= set(seen):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"waited for {kind} of {len(done - set(seen))} sessions")
            batches = await self.tail.getmany(timeout_ms=200)
            now = time.perf_counter()
            for records in batches.values():
                for record in records:
                    session = (record.key or b"").decode()
                    self.first.setdefault(session, now)
                    if record.value is not None and b"turn/end" in record.value:
                        self.turn_ends.setdefault(session, now)

    async def ready(self, timeout_s: float = 3600) -> None:
        """Until the driver printed its ``ready`` line: every partition built (migrated)."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline),
                                      timeout_s)
        if not line.startswith(b"ready"):
            raise RuntimeError(f"the driver exited before it was ready: {line!r}")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    async def stop(self) -> dict[str, int]:
        if self.tail is not None:
            await self.tail.stop()
        self.process.terminate()
        out, _ = self.process.communicate(timeout=120)
        for line in reversed(out.decode().splitlines()):
            if line.startswith("{"):
                counters: dict[str, int] = json.loads(line)
                return counters
        return {}


async def follow_up(settings: Settings, sessions: list[str]) -> None:
    codec = InboxCodec()
    await send_records(settings, [OutRecord(
        settings.topics.inbox, s.encode(),
        codec.encode(FollowUp(s, str(uuid.uuid4()), ({"type": "text", "text": "go"},))))
        for s in sessions])


async def command_to_first_event(driven: Driven, sessions: list[str]) -> list[float]:
    """Milliseconds from each command's send to its session's next event, one at a time."""
    samples = []
    for session in sessions:
        driven.first.pop(session, None)
        sent = time.perf_counter()
        await follow_up(driven.settings, [session])
        await driven.wait({session}, "first", 60)
        samples.append((driven.first[session] - sent) * 1000)
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_size(bootstrap: str, events: int, wakeups: int, active_count: int
                   ) -> dict[str, float]:
    settings = _settings(bootstrap)
    await ensure_topics(settings)
    old = await publish_history(settings, events)
    migrating = Driven(settings)
    await migrating.ready()  # every partition migrated
    migrate_s = time.perf_counter() - migrating.started
    await migrating.stop()
    driven = Driven(settings)  # the timed start
    await driven.start_tail()
    await follow_up(settings, ["new-0"])
    await driven.wait({"new-0"}, "turn")
    start_s = driven.turn_ends["new-0"] - driven.started
    active = [f"active-{n}" for n in range(active_count)]
    await follow_up(settings, active)
    await driven.wait(set(active), "turn")
    rss = driven.rss_mib()
    woken = await command_to_first_event(driven, old[:wakeups])
    anchor = await command_to_first_event(driven, active[:wakeups])
    counters = await driven.stop()
    return {"events": len(old) * SESSION_EVENTS, "migrate_s": round(migrate_s, 2),
            "start_to_turn_s": round(start_s, 3), "rss_mib": round(rss, 1),
            "wake_p99_ms": round(percentile(woken, 0.99), 1),
            "wake_p50_ms": round(percentile(woken, 0.5), 1),
            "anchor_p99_ms": round(percentile(anchor, 0.99), 1),
            "anchor_p50_ms": round(percentile(anchor, 0.5), 1),
            "session_records_read": counters.get("session_records_read", -1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--wakeups", type=int, default=100)
    parser.add_argument("--active", type=int, default=1000, help="sessions active for the RSS")
    parser.add_argument("--bootstrap", default=None)
    args = parser.parse_args()
    with kafka_for(args.bootstrap) as bootstrap:
        for size in args.sizes:
            result = asyncio.run(one_size(bootstrap, size, args.wakeups, args.active))
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
