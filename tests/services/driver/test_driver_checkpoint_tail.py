"""Checkpoints at rest points, and a takeover that reads the bounded tail after them.

A driver writes a session's checkpoint when the session comes to rest (a turn ended, an
approval waits), not with every transaction (``checkpoint_plan.py``). A driver killed mid-turn
therefore leaves sessions whose newest events are not in any checkpoint: the next owner reads
the session partition from the tail mark its inbox commit carries, never from offset 0 and
never before the events of the turns that were running, folds them onto the checkpoints, and
repairs the open turns. Checked against a replay: no gap, no duplicate, every command once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from driver_topics import PARTITIONS
from test_driver_crash import all_events, start_driver
from wait_support import driver_owning

from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.inbox import InboxCodec
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.services.driver.partition import PartitionContext
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(420)]
SESSIONS = [f"tail-{n}" for n in range(6)]
SLOW = ["--script", "tool-loop", "--script-chunk-delay-ms", "400"]


async def follow_ups(settings: Settings, sent: dict[str, list[str]], text: str) -> None:
    records = []
    for session, ids in sent.items():
        ids.append(str(uuid.uuid4()))
        command = FollowUp(session, ids[-1], ({"type": "text", "text": text},))
        records.append(OutRecord(settings.topics.inbox, session.encode(),
                                 InboxCodec().encode(command)))
    await send_records(settings, records)


async def session_ends(settings: Settings) -> int:
    """The sum of the session partitions' end offsets."""
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topics.session_events, p) for p in range(PARTITIONS)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def count(events: list[Event], kind: str) -> int:
    return sum(1 for e in events if e.type == kind)


async def wait_for(settings: Settings, done: object) -> dict[str, list[Event]]:
    assert callable(done)
    while True:
        found = await all_events(settings)
        if all(done(found.get(s, [])) for s in SESSIONS):
            return found
        await asyncio.sleep(0.1)


def context(settings: Settings) -> PartitionContext:
    ctx = driver_context(settings, group_id=f"{settings.group_id_prefix}driver",
                         tools=builtin_registry(), linger_ms=10)
    return dataclasses.replace(ctx, idle_evict_s=600.0)


async def test_a_kill_mid_turn_is_taken_over_from_the_tail_after_the_checkpoints(
        topics: Settings) -> None:
    settings = topics
    sent: dict[str, list[str]] = {s: [] for s in SESSIONS}
    process = await start_driver(settings, extra_args=SLOW)
    try:
        await follow_ups(settings, sent, "turn 1")  # history, ended: every session at rest
        await asyncio.wait_for(wait_for(settings, lambda e: count(e, "turn/end") == 1), 120)
        at_rest = await session_ends(settings)
        await follow_ups(settings, sent, "turn 2")  # killed once each has a step committed
        await asyncio.wait_for(wait_for(
            settings, lambda e: count(e, "step/end") >= 3 or count(e, "turn/end") == 2), 120)
    finally:
        process.kill()  # SIGKILL: no shutdown, no last checkpoints
        await process.wait()
    found = await all_events(settings)
    mid_turn = [s for s in SESSIONS if count(found[s], "turn/end") == 1]
    assert mid_turn, "every turn ended before the kill: nothing to take over mid-turn"
    written = await session_ends(settings)

    ctx = context(settings)
    async with driver_owning(ctx, PARTITIONS) as service:
        assert ctx.checkpoints.session_records_read == 0  # never the partition from offset 0
        assert 0 < ctx.checkpoints.tail_records_read <= written - at_rest  # only turn 2's
        assert service.metrics.turns_repaired == len(mid_turn)
        await follow_ups(settings, sent, "turn 3")
        found = await asyncio.wait_for(
            wait_for(settings, lambda e: count(e, "turn/end") == 3), 120)
    for session in SESSIONS:
        events = found[session]
        log = SessionLog(session, mode="strict")
        log.extend(events)  # no duplicate, no missing seq
        assert not log.turn.in_turn
        reasons = [e.data["reason"]["kind"] for e in events
                   if e.type == "turn/end"]
        assert reasons.count("interrupted") == (1 if session in mid_turn else 0)
        inserted = [item["id"] for e in events if e.type == "agent/inbox/spliced"
                    for item in e.data.get("inserted", [])]
        assert Counter(inserted) == Counter(sent[session]), f"{session}: not entered once"
        assert inserted == sent[session]


async def test_a_graceful_release_leaves_no_tail(topics: Settings) -> None:
    """A released partition's sink checkpoints every session with newer events: the next
    owner reads no session-topic record at all."""
    settings = topics
    sent: dict[str, list[str]] = {s: [] for s in SESSIONS}
    first = context(settings)
    async with driver_owning(first, PARTITIONS):
        await follow_ups(settings, sent, "turn 1")
        await asyncio.wait_for(wait_for(settings, lambda e: count(e, "turn/end") == 1), 120)
        await follow_ups(settings, sent, "turn 2")
        await asyncio.wait_for(wait_for(settings, lambda e: count(e, "turn/start") == 2), 120)
    second = context(settings)
    async with driver_owning(second, PARTITIONS):
        assert second.checkpoints.session_records_read == 0
        assert second.checkpoints.tail_records_read == 0
