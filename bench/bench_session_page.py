"""Dashboard session page ready against the derived messages of many sessions (issue 28).

For each size (sessions; default 100 and 10,000) and each layout, a fresh topic prefix gets
the project's topics and:

- ``processors``: ``SESSION_EVENTS`` synthetic events per session on the session topic,
  folded by a ``dsh-pipeline processors`` child; the dashboard asks it for each page
  (``DSH_DASHBOARD_PROCESSORS_URL``) and reads no derived record;
- ``session`` / ``key``: ``SLOTS`` derived records per session, written as the processors
  write them, with the ``session`` layout (each session's records in its session's
  partition, the layout named in the projection pointer) or the ``key`` layout of topics
  written before layouts existed (the default partitioner's; the page reads every
  partition).

A dashboard runs in this process on each prefix; a page is timed from the request of
``/api/stream/sessions/ID`` to its ``snapshot`` frame (the derived messages read and
decoded), for ``--pages`` sessions drawn at random, and again until it has caught up with
the session topic (``caught-up``: live); the derived records it read (its ``recordsRead``)
and the session-topic records the pages read are reported.

    .venv/bin/python bench/bench_session_page.py [--bootstrap HOST:PORT] [--sizes 100 10000]

Prints one JSON line per size and layout: snapshot p50/p99/max and ready (caught up)
p50/p99 in ms, the median derived records read and the session records read per page.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
from suite_core import kafka_for

from dsh_dev.cli.demo_fleet import start_processors
from dsh_dev.localstack.process import ChildProcess, free_ports
from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.projection_pointer import write_pointer_records
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.codec.avro import EventSerde
from pipeline.codec.outputs import default_output_codecs
from pipeline.codec.records import event_headers
from pipeline.core.projection import MessageChange, layout_key
from pipeline.services.dashboard.server import start_dashboard
from pipeline.settings import Settings

PARTITIONS = 6
SLOTS = 20          # derived messages per session
SESSION_EVENTS = 60  # events per session of the processors layout (synthetic turns)
FOLD_TIMEOUT_S = 900.0
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


async def write_sessions(settings: Settings, sessions: list[str]) -> dict[str, int]:
    """``sessions`` of ``SESSION_EVENTS`` synthetic events each on the session topic (as the
    driver writes them); each session's next seq."""
    await ensure_topics(settings)
    topic, serde = settings.topics.session_events, EventSerde()
    async with BulkProducer(settings) as out:
        for index, session_id in enumerate(sessions):
            events = synth_session(index, SESSION_EVENTS)
            await out.send_many(topic, [(session_id.encode(), serde.encode(session_id, e),
                                         list(event_headers(e))) for e in events])
        await out.flush()
    return dict.fromkeys(sessions, SESSION_EVENTS)


async def wait_folded(worker: ChildProcess, url: str, next_seqs: dict[str, int]) -> None:
    """Wait until the worker at ``url`` vouches for the last session of each partition at
    its end (``GET /sessions/{id}/page``)."""
    last = {partition_for(s, PARTITIONS): s for s in next_seqs}
    deadline = time.monotonic() + FOLD_TIMEOUT_S
    async with httpx.AsyncClient(timeout=30.0) as client:
        while last:
            if not worker.alive() or time.monotonic() > deadline:
                raise RuntimeError("the processors worker did not fold the sessions in time; "
                                   f"its log ends:\n{worker.log_tail()}")
            for partition, session_id in list(last.items()):
                with contextlib.suppress(httpx.HTTPError):
                    answer = await client.get(f"{url}/sessions/{session_id}/page")
                    if answer.status_code == 200 and \
                            answer.json()["nextSeq"] == next_seqs[session_id]:
                        del last[partition]
            await asyncio.sleep(0.5)


@dataclasses.dataclass(slots=True)
class Page:
    snapshot_ms: float = 0.0    # request -> the snapshot frame
    caught_up_ms: float = 0.0   # request -> caught up with the session topic (live)
    records_read: int = 0       # derived records read
    basis: str = ""


async def open_page(client: httpx.AsyncClient, url: str) -> Page:
    """One page, timed until it has caught up with the session's events."""
    started, page, event = time.perf_counter(), Page(), ""
    async with client.stream("GET", url) as response:
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event == "snapshot":
                page.snapshot_ms = (time.perf_counter() - started) * 1000
                snapshot = json.loads(line.partition(":")[2])
                page.records_read, page.basis = snapshot["recordsRead"], snapshot["basis"]
            elif line.startswith("data:") and event == "caught-up":
                page.caught_up_ms = (time.perf_counter() - started) * 1000
                return page
    raise RuntimeError(f"{url}: the stream ended before it caught up")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(settings: Settings, sessions: list[str], pages: int) -> dict[str, float]:
    dashboard = await start_dashboard(settings, EventSerde().decode, host="127.0.0.1", port=0)
    try:
        async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (await client.get(dashboard.url + "health")).json().get("ready"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the dashboard was not ready in time")
                await asyncio.sleep(0.2)
            opened = [await open_page(client, f"{dashboard.url}api/stream/sessions/{sid}")
                      for sid in random.Random(7).sample(sessions, min(pages, len(sessions)))]
            health = (await client.get(dashboard.url + "health")).json()
    finally:
        await dashboard.stop()
    snapshots, ready = [p.snapshot_ms for p in opened], [p.caught_up_ms for p in opened]
    return {"p50_ms": statistics.median(snapshots), "p99_ms": percentile(snapshots, 0.99),
            "max_ms": max(snapshots),
            "ready_p50_ms": statistics.median(ready), "ready_p99_ms": percentile(ready, 0.99),
            "records_read": statistics.median(p.records_read for p in opened),
            "session_records_per_page": health["sessionTopicReads"]["records"] / len(opened),
            "bases": dict(collections.Counter(p.basis for p in opened))}


async def measure_processors(settings: Settings, sessions: list[str], pages: int
                             ) -> dict[str, float]:
    """The sessions' events folded by a processors worker, pages started from its tables."""
    next_seqs = await write_sessions(settings, sessions)
    with tempfile.TemporaryDirectory(prefix="bench-page-") as state_dir:
        port = free_ports(1)[0]
        url = f"http://127.0.0.1:{port}"
        # its tables in the temporary directory; its log beside them (read if it fails)
        worker = start_processors(dataclasses.replace(settings, state_dir=state_dir), port,
                                  Path(state_dir) / "processors.log")
        try:
            await wait_folded(worker, url, next_seqs)
            asked = dataclasses.replace(settings, dashboard_processors_url=url)
            return await measure(asked, sessions, pages)
        finally:
            worker.stop(30)


async def run(bootstrap: str, sizes: list[int], pages: int, layouts: list[str]) -> None:
    for size in sizes:
        for layout in layouts:
            settings = settings_for(bootstrap, f"{size}-{layout}")
            sessions = session_ids(size)
            if layout == "processors":
                result = await measure_processors(settings, sessions, pages)
            else:
                await write_derived(settings, sessions, layout)
                result = await measure(settings, sessions, pages)
            print(json.dumps({"sessions": size, "layout": layout, **result}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", help="a running Kafka (default: start one here)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 10_000])
    parser.add_argument("--pages", type=int, default=30, help="pages timed per size")
    parser.add_argument("--layouts", nargs="+", default=["processors", "session", "key"],
                        choices=["processors", "session", "key"],
                        help="processors: the sessions' events folded by a processors worker "
                             "and pages started from its tables (DSH_DASHBOARD_PROCESSORS_URL)"
                             "; session, key: derived records in that layout, read by the page")
    args = parser.parse_args(argv)
    with kafka_for(args.bootstrap) as bootstrap:
        asyncio.run(run(bootstrap, args.sizes, args.pages, args.layouts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
