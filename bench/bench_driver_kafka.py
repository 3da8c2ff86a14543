"""Benchmark: the Kafka driver end to end, with the scripted provider.

Starts a local single-node Kafka (or uses ``--bootstrap``), creates fresh topics, runs one
in-process driver, puts one follow-up per session on the inbox (``--sessions``, each a
two-step tool turn: tool call, then the answer) and reads the session topic back
read_committed until every turn has ended. Reports:

* ``steps_per_s``: steps (``step/end`` records) committed per second of wall time, from the
  first inbox send to the last ``turn/end`` seen by a read-committed consumer;
* ``visible_ms_p50/p99``: for every event, the time from its ``time`` stamp (set by the
  runner when it was appended) to when a read-committed consumer received it: what the
  batching into transactions costs a live reader;
* ``transactions``, ``events``, ``events_per_transaction``;
* ``cpu_seconds`` / ``steps_per_cpu_s``: this process's CPU time (driver and the reading
  consumer; the broker runs in its own process): the figure that matters on a loaded machine;
* ``invalid_logs``: sessions whose log does not rebuild in strict mode (must be 0).

    .venv/bin/python bench/bench_driver_kafka.py --sessions 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Iterator

from aiokafka import AIOKafkaConsumer

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.llm.scripted import tool_loop_script
from pipeline.adapters.localstack.artifacts import Artifacts
from pipeline.adapters.localstack.kafka import KafkaLocal
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.errors import DshError
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    with KafkaLocal(Artifacts.default().require_kafka(), heap_mb=1024) as kafka:
        yield kafka.bootstrap


async def read_until_done(settings: Settings, sessions: int) -> tuple[dict[str, list[Event]],
                                                                       list[float], float]:
    serde = EventSerde()
    consumer = AIOKafkaConsumer(settings.topics.session_events, **client_options(settings),
                                group_id=None, isolation_level="read_committed",
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    logs: dict[str, list[Event]] = {}
    visible_ms: list[float] = []
    ended = 0
    try:
        while ended < sessions:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            now_ms = time.time() * 1000
            for records in batch.values():
                for record in records:
                    session_id, event = serde.decode(record.value)
                    logs.setdefault(session_id, []).append(event)
                    visible_ms.append(now_ms - event.time)
                    ended += event.type == "turn/end"
    finally:
        await consumer.stop()
    return logs, visible_ms, time.perf_counter()


async def run(bootstrap: str, sessions: int, partitions: int, linger_ms: float,
              pipelined: bool = False) -> dict[str, float]:
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    settings = Settings.from_env({}, bootstrap_servers=bootstrap, topic_prefix=prefix,
                                 partitions=partitions, group_id_prefix=prefix)
    await ensure_topics(settings)
    ctx = driver_context(settings, group_id=f"{prefix}driver", tools=builtin_registry(),
                         linger_ms=linger_ms,
                         script=tool_loop_script("echo", '{"text": "pong"}'),
                         pipelined_flush=pipelined)
    service = DriverService(ctx, DriverConfig(linger_ms=linger_ms,
                                              max_turns_in_flight=max(sessions, 2),
                                              resume_below=max(sessions, 2) - 1))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 60)
    codec = InboxCodec()
    records = [OutRecord(settings.topics.inbox, f"s{n}".encode(), codec.encode(
        FollowUp(f"s{n}", f"m{n}", ({"type": "text", "text": f"ping {n}"},))))
        for n in range(sessions)]
    reader = asyncio.create_task(read_until_done(settings, sessions))
    started, cpu_started = time.perf_counter(), time.process_time()
    await send_records(settings, records)
    logs, visible_ms, finished = await reader
    metrics = service.metrics_snapshot()
    metrics["cpu_ms"] = int((time.process_time() - cpu_started) * 1000)
    stop.set()
    await task
    return summarize(logs, visible_ms, finished - started, metrics)


def summarize(logs: dict[str, list[Event]], visible_ms: list[float], elapsed: float,
              metrics: dict[str, int]) -> dict[str, float]:
    invalid = 0
    for session_id, events in logs.items():
        try:
            SessionLog.from_events(session_id, events)
        except DshError:
            invalid += 1
    steps = sum(1 for events in logs.values() for e in events if e.type == "step/end")
    events = sum(len(v) for v in logs.values())
    cuts = statistics.quantiles(visible_ms, n=100)
    return {"sessions": len(logs), "steps": steps, "events": events,
            "elapsed_s": round(elapsed, 3), "steps_per_s": round(steps / elapsed, 1),
            "events_per_s": round(events / elapsed, 1),
            "visible_ms_p50": round(cuts[49], 1), "visible_ms_p99": round(cuts[98], 1),
            "cpu_seconds": metrics["cpu_ms"] / 1000,
            "steps_per_cpu_s": round(steps / max(metrics["cpu_ms"] / 1000, 1e-3), 1),
            "transactions": metrics["transactions"],
            "events_per_transaction": round(events / max(metrics["transactions"], 1), 1),
            "invalid_logs": invalid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--linger-ms", type=float, default=25.0)
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    parser.add_argument("--pipelined-flush", action="store_true",
                        help="step boundaries do not wait for their commit")
    parser.add_argument("--warmup", type=int, default=20,
                        help="sessions of a first, unmeasured run")
    args = parser.parse_args()
    with broker(args.bootstrap) as bootstrap:
        if args.warmup:  # a fresh broker creates its offsets/transaction topics on first use
            asyncio.run(run(bootstrap, args.warmup, args.partitions, args.linger_ms))
        result = asyncio.run(run(bootstrap, args.sessions, args.partitions, args.linger_ms,
                                 args.pipelined_flush))
    print(json.dumps({**result, "partitions": args.partitions,
                      "pipelined_flush": args.pipelined_flush}))


if __name__ == "__main__":
    main()
