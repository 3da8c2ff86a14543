"""A session of any length: 300,000 events, a compaction every 3 turns and 40,000+ surface
messages over its life, folded by a real worker on the broker.

It must fold to exactly core's derivation, never be dead-lettered, keep its state records
under a fixed bound (the ``sessions`` record and the live ``nodes`` records, read back from
their changelogs), answer ``?at_seq=`` from the log, and a worker restarted after a kill -9
must equal the replay too."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from processors_support import (
    SessionBuilder,
    Worker,
    committed_and_ends,
    event_records,
    free_port,
    fresh_settings,
    read_topic,
)

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.core.events import Event, Replace
from pipeline.core.log import derive_messages
from pipeline.services.processors.options import ProcessorsOptions
from pipeline.services.processors.verify import verify_processors

pytestmark = pytest.mark.broker

EVENTS = 300_000
COMPACT_EVERY_TURNS = 3
# The session's table record: its live surface (a few dozen nodes between compactions, each
# two seqs and maybe a digest) plus usage and fleet; ~1 KB in practice. The bound is fixed,
# whatever the number of events (the record used to grow ~30 bytes per surface message).
SESSION_RECORD_BOUND = 16_384
LIVE_NODES_BOUND = 400   # nodes records alive at the end (the live surface)
COMMIT_S = 300.0     # the last commits, persists included, on that machine
RECOVERY_S = 600.0   # on a loaded 2-core machine faust recovered ~1,000 records/s


def long_session(seed: int, events: int) -> list[Event]:
    """Turns of 1-3 steps (tool calls, chunks, usage, random replaces), and every
    ``COMPACT_EVERY_TURNS`` turns a compaction: a summary replacing all but the last live
    surface node, as dsh does when it compacts the context."""
    rng = random.Random(seed)
    builder = SessionBuilder(rng, "long", "m", int(time.time() * 1000), max_chunks=16)
    turn = 0
    while len(builder.events) < events:
        turn += 1
        if turn % COMPACT_EVERY_TURNS == 0 and len(builder.surface) >= 3:
            _compact(builder, turn)
        builder.turn(turn)
    return builder.events[:events]


def _compact(builder: SessionBuilder, turn: int) -> None:
    run = builder.surface[:-1]
    builder.add("compaction/start", {"compactionId": f"c{turn}", "nodes": len(run)})
    summary = {"id": f"sum{turn}", "role": "user", "source": {"kind": "plugin"},
               "content": [{"type": "text", "text": f"Earlier context, compacted ({turn})."}]}
    seq = builder.add("user/message", summary, Replace(run[0], run[-1]), tuple(run))
    builder.surface[:len(run)] = [seq]
    builder.add("compaction/end", {"compactionId": f"c{turn}"})


def test_the_long_session_is_what_the_issue_asks_for() -> None:
    events = long_session(7, 20_000)
    surface = sum(1 for e in events if e.surface_op is not None)
    compactions = sum(1 for e in events if e.type == "compaction/start")
    assert surface > 20_000 * 40_000 // EVENTS   # 40,000+ over 300,000 events
    assert compactions > 20_000 // 100
    assert derive_messages(events)   # valid: core folds it


def _ready(worker: Worker) -> bool:
    status, body = worker.get("/health")
    return status == 200 and not body["recovery"]["in_recovery"] and bool(body["partitions"])


async def _send(settings: Any, records: list[Any]) -> None:
    async with BulkProducer(settings) as out:
        for record in records:
            await out.send(record.topic, record.key, record.value, record.headers)


async def _committed_to_the_end(settings: Any, worker: Worker) -> None:
    deadline = time.monotonic() + COMMIT_S
    while True:
        committed, ends = await committed_and_ends(settings)
        if committed == ends:
            return
        assert time.monotonic() < deadline, (committed, ends, worker.tail())
        await asyncio.sleep(0.5)


def _get_json(url: str) -> Any:
    """GET with room for reading the session back from the log (minutes on a slow CI)."""
    try:
        with urllib.request.urlopen(url, timeout=360) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: {exc.code} {exc.read()[:500]!r}") from None


def _last_values(records: list[tuple[str, Any, dict[str, bytes]]]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    for key, value, _headers in records:
        last[key] = value
    return last


async def _raw_sizes(settings: Any, topic: str) -> dict[str, int]:
    """The size of the last value of every key of ``topic`` (0: a tombstone)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(settings.partitions)]
        consumer.assign(parts)
        ends = await consumer.end_offsets(parts)
        sizes: dict[str, int] = {}
        while [tp for tp in parts if await consumer.position(tp) < ends[tp]]:
            for batch in (await consumer.getmany(*parts, timeout_ms=500)).values():
                for record in batch:
                    sizes[record.key.decode()] = len(record.value or b"")
        return sizes
    finally:
        await consumer.stop()


async def test_a_300k_event_session_folds_exactly_within_a_fixed_state_bound(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = fresh_settings(kafka_bootstrap, partitions=1)
    await ensure_topics(settings)
    started = time.monotonic()
    everything = long_session(11, EVENTS + 2_000)
    events, more = everything[:EVENTS], everything[EVENTS:]
    print(f"generated: {time.monotonic() - started:.1f} s")
    assert sum(1 for e in events if e.surface_op is not None) >= 40_000
    sid = "long-s0"
    logs = {sid: events}
    worker = Worker(settings, free_port(), tmp_path)
    try:
        worker.wait_for("worker ready", lambda: _ready(worker), RECOVERY_S)
        await _send(settings, event_records(settings, sid, events))
        print(f"sent: {time.monotonic() - started:.1f} s")
        report = await verify_processors(worker.url(""), logs, timeout_s=240)
        print(f"verified: {time.monotonic() - started:.1f} s")
        assert report.ok, (report.problems, worker.tail())
        for at in (0, EVENTS // 3, EVENTS - 2):
            started = time.monotonic()
            body = _get_json(worker.url(f"/sessions/{sid}/messages?at_seq={at}"))
            print(f"at_seq={at}: {time.monotonic() - started:.1f} s")
            assert body["messages"] == list(derive_messages(events[:at + 1]))
        health = worker.get("/health")[1]
        assert health["counters"]["dead_letters"] == 0, health
        await _committed_to_the_end(settings, worker)   # its state is written by then
    finally:
        worker.kill9()

    app_id = ProcessorsOptions().app_id(settings)
    sizes = await _raw_sizes(settings, f"{app_id}-sessions-changelog")
    print(f"session record: {sizes.get(sid)} bytes")
    assert 0 < sizes.get(sid, 0) <= SESSION_RECORD_BOUND, sizes
    nodes = await _raw_sizes(settings, f"{app_id}-nodes-changelog")
    live = [key for key, size in nodes.items() if size and key.startswith(f"{sid}/")]
    print(f"live nodes records: {len(live)} (of {len(nodes)} keys written)")
    assert 0 < len(live) <= LIVE_NODES_BOUND, len(live)
    assert await read_topic(settings, settings.topics.dlq(settings.topics.session_events)) == []

    restarted = Worker(settings, free_port(), tmp_path)
    try:
        started = time.monotonic()
        # It recovers the tables from their changelogs: ~100,000 records here (every node
        # written, and deleted when a replace took it off), as long as the broker has not
        # compacted them (a memory store reads them all; rocksdb only the tail).
        restarted.wait_for("worker ready", lambda: _ready(restarted), RECOVERY_S)
        print(f"restarted, recovered: {time.monotonic() - started:.1f} s")
        await send_records(settings, event_records(settings, sid, more))
        report = await verify_processors(restarted.url(""), {sid: events + more},
                                         timeout_s=240)
        assert report.ok, (report.problems, restarted.tail())
    finally:
        restarted.stop()
