"""Dashboard session page ready against the derived messages of many sessions (issue 28).

For each size (sessions whose derived messages lie on the derived-messages topic; default
100 and 10,000, ``SLOTS`` messages each), a fresh topic prefix gets the project's topics and
the derived records, written as the processors write them: with the ``session`` layout (each
session's records in its session's partition, the layout named in the projection pointer)
and, for contrast, with the ``key`` layout of topics written before layouts existed (the
default partitioner's; the page then reads every partition). A dashboard runs in this
process on each prefix; a page is timed from the request of ``/api/stream/sessions/ID`` to
its ``snapshot`` frame (the derived messages read and decoded), for ``--pages`` sessions
drawn at random, and the records it read (its ``recordsRead``) are reported.

    .venv/bin/python bench/bench_session_page.py [--bootstrap HOST:PORT] [--sizes 100 10000]

Prints one JSON line per size and layout: p50/p99/max in ms and the median records read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
from suite_core import kafka_for

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.projection_pointer import write_pointer_records
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import default_output_codecs
from pipeline.core.projection import MessageChange, layout_key
from pipeline.services.dashboard.server import start_dashboard
from pipeline.settings import Settings

PARTITIONS = 6
SLOTS = 20          # derived messages per session
TEXT = "a message of the conversation, about as long as a short chat turn. " * 3
READY_TIMEOUT_S = 120.0


def settings_for(bootstrap: str, label: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap, partitions=PARTITIONS,
                    topic_prefix=f"bench-page-{label}-{uuid.uuid4().hex[:6]}.",
                    group_id_prefix=f"bench-page-{uuid.uuid4().hex[:6]}-")


def session_ids(count: int) -> list[str]:
    return [f"page-s{index:06d}" for index in range(count)]


def changes_of(session_id: str) -> Iterator[MessageChange]:
    for slot in range(SLOTS):
        role = "user" if slot % 2 == 0 else "assistant"
        yield MessageChange(session_id, slot * 3, slot * 3, slot * 3, "append",
                            {"role": role, "content": f"{slot}: {TEXT}"})


async def write_derived(settings: Settings, sessions: list[str], layout: str) -> None:
    """The derived records of ``sessions`` on version 0, in ``layout``."""
    await ensure_topics(settings)
    topic = settings.topics.derived_messages
    if layout == "session":
        await write_pointer_records(settings, {layout_key("derived-messages", topic):
                                               {"layout": "session"}})
    encode = default_output_codecs().derived.encode_change
    partition_of = None
    if layout == "session":
        def partition_of(key: bytes) -> int:
            return partition_for(key.decode().rpartition("/")[0], settings.partitions)
    async with BulkProducer(settings) as out:
        await out.send_many(topic, ((c.key.encode(), encode(c), ()) for sid in sessions
                                    for c in changes_of(sid)), partition_of=partition_of)
        await out.flush()


async def page_ms(client: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """Request to the snapshot frame, and the records the page read."""
    started = time.perf_counter()
    async with client.stream("GET", url) as response:
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event == "snapshot":
                elapsed = (time.perf_counter() - started) * 1000
                return elapsed, int(json.loads(line.partition(":")[2])["recordsRead"])
    raise RuntimeError(f"{url}: the stream ended without a snapshot frame")


async def measure(settings: Settings, sessions: list[str], pages: int) -> dict[str, float]:
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0)
    try:
        async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (await client.get(dashboard.url + "health")).json().get("ready"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the dashboard was not ready in time")
                await asyncio.sleep(0.2)
            times, reads = [], []
            for session_id in random.Random(7).sample(sessions, min(pages, len(sessions))):
                ms, read = await page_ms(client, dashboard.url + f"api/stream/sessions/"
                                                              f"{session_id}")
                times.append(ms)
                reads.append(read)
    finally:
        await dashboard.stop()
    ordered = sorted(times)
    return {"p50_ms": statistics.median(ordered),
            "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max_ms": ordered[-1], "records_read": statistics.median(reads)}


async def run(bootstrap: str, sizes: list[int], pages: int, layouts: list[str]) -> None:
    for size in sizes:
        for layout in layouts:
            settings = settings_for(bootstrap, f"{size}-{layout}")
            sessions = session_ids(size)
            await write_derived(settings, sessions, layout)
            result = await measure(settings, sessions, pages)
            print(json.dumps({"sessions": size, "layout": layout, **result}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", help="a running Kafka (default: start one here)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 10_000])
    parser.add_argument("--pages", type=int, default=30, help="pages timed per size")
    parser.add_argument("--layouts", nargs="+", default=["session", "key"],
                        choices=["session", "key"])
    args = parser.parse_args(argv)
    with kafka_for(args.bootstrap) as bootstrap:
        asyncio.run(run(bootstrap, args.sizes, args.pages, args.layouts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
