"""The driver bounded by live state, on a real broker.

- A driver that takes over partitions holding history reads the checkpoint topic, and no
  session-topic record: counted from what it fetched (its store's counters), while follow-ups
  to old sessions go on with no gap and no duplicate.
- Idle sessions leave memory and come back on their next command, equal to a replay.
- A topic written without checkpoints (by a driver of the previous release, or the session
  events of the in-memory driver published as they are) is migrated once: its open turn is
  repaired, its sessions go on, and the next takeover reads the session topic no more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter

import pytest
from driver_topics import driver_topics
from wait_support import driver_owning, until

from dsh_dev.synth import synth_session
from pipeline.adapters.kafka.event_stream import partition_for
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.adapters.kafka.topic_scan import BulkProducer
from pipeline.adapters.llm.scripted import ScriptedProvider, ScriptedReply, echo_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import event_headers
from pipeline.core.events import Event
from pipeline.core.inbox import Configure, FollowUp
from pipeline.core.log import SessionLog, derive_messages
from pipeline.core.model import ModelRequest
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.partition import PartitionContext
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.timeout(420)]
PARTITIONS = 2
SERDE = EventSerde()


@pytest.fixture
async def two_partition_topics(kafka_bootstrap: str, topic_prefix: str) -> Settings:
    """The shared ``topics`` fixture's settings, on 2 partitions instead of 3."""
    return await driver_topics(kafka_bootstrap, topic_prefix, PARTITIONS)


def context(settings: Settings, *, idle_evict_s: float = 600.0) -> PartitionContext:
    ctx = driver_context(settings, group_id=f"{settings.group_id_prefix}driver",
                         tools=builtin_registry(), linger_ms=10)
    return dataclasses.replace(ctx, idle_evict_s=idle_evict_s)


def partition_of(session_id: str) -> int:
    return partition_for(session_id, PARTITIONS)


async def follow_up(settings: Settings, session_id: str, text: str) -> str:
    message_id = str(uuid.uuid4())
    command = FollowUp(session_id, message_id, ({"type": "text", "text": text},))
    await send_records(settings, [OutRecord(settings.topics.inbox, session_id.encode(),
                                            InboxCodec().encode(command))])
    return message_id


async def all_events(settings: Settings) -> dict[str, list[Event]]:
    found: dict[str, list[Event]] = {}
    for partition in range(PARTITIONS):
        contents = await read_session_partition(settings, settings.topics.session_events,
                                                partition, SERDE.decode)
        found.update(contents.events)
    return found


def ended_turns(events: list[Event]) -> int:
    return sum(1 for e in events if e.type == "turn/end")


async def wait_turns(settings: Settings, wanted: dict[str, int]) -> dict[str, list[Event]]:
    """Until each session of ``wanted`` has that many ended turns; its events."""
    while True:
        found = await all_events(settings)
        if all(ended_turns(found.get(s, [])) >= n for s, n in wanted.items()):
            return found
        await asyncio.sleep(0.2)


def check_replay(events: list[Event], message_ids: list[str]) -> None:
    """The strict log rebuilds (no gap, no duplicate, no open turn) and every command
    entered the session exactly once, in order."""
    log = SessionLog.from_events("s", events)
    assert not log.turn.in_turn
    inserted = [item["id"] for e in events if e.type == "agent/inbox/spliced"
                for item in e.data.get("inserted", [])]  # type: ignore[union-attr]
    assert inserted == message_ids
    assert Counter(inserted).most_common(1)[0][1] == 1


async def test_a_takeover_reads_checkpoints_not_the_session_topic(
        two_partition_topics: Settings) -> None:
    settings = two_partition_topics
    sessions = [f"old-{n}" for n in range(8)]
    sent: dict[str, list[str]] = {s: [] for s in sessions}
    first = context(settings)
    async with driver_owning(first, PARTITIONS):
        for turn in range(2):
            for session in sessions:
                sent[session].append(await follow_up(settings, session, f"turn {turn}"))
            await asyncio.wait_for(wait_turns(settings, {s: turn + 1 for s in sessions}), 60)
    assert first.checkpoints.session_records_read == 0  # a new topic: marked, nothing read
    second = context(settings)
    async with driver_owning(second, PARTITIONS) as service:
        assert second.checkpoints.session_records_read == 0
        assert second.checkpoints.checkpoint_records_read >= len(sessions)
        assert sum(len(o.sessions) for o in service.owned.values()) == 0  # all idle
        for session in sessions[:3]:
            sent[session].append(await follow_up(settings, session, "after the takeover"))
        found = await asyncio.wait_for(
            wait_turns(settings, {s: 3 for s in sessions[:3]}), 60)
        assert second.metrics.sessions_loaded == 3
    assert second.checkpoints.session_records_read == 0
    for session in sessions:
        check_replay(found[session], sent[session])


async def test_idle_sessions_leave_memory_and_come_back(
        two_partition_topics: Settings) -> None:
    settings = two_partition_topics
    ctx = context(settings, idle_evict_s=0.4)
    sessions = [f"idle-{n}" for n in range(6)]
    sent: dict[str, list[str]] = {s: [] for s in sessions}
    async with driver_owning(ctx, PARTITIONS) as service:
        for session in sessions:
            sent[session].append(await follow_up(settings, session, "first"))
        await asyncio.wait_for(wait_turns(settings, {s: 1 for s in sessions}), 60)
        await until(lambda: sum(len(o.sessions) for o in service.owned.values()) == 0,
                    "every idle session left memory")
        assert ctx.metrics.sessions_evicted >= len(sessions)
        for session in sessions:
            sent[session].append(await follow_up(settings, session, "second"))
            sent[session].append(await follow_up(settings, session, "third"))
        found = await asyncio.wait_for(wait_turns(settings, {s: 3 for s in sessions}), 60)
        assert ctx.metrics.sessions_loaded >= len(sessions)
    assert ctx.checkpoints.session_records_read == 0
    for session in sessions:
        check_replay(found[session], sent[session])


async def _in_memory_logs() -> dict[str, list[Event]]:
    """Sessions as the driver's own turn logic writes them: two ended turns each, and one
    session cut in the middle of its third turn (a crash before its turn ended)."""
    driver = Driver(provider_factory=lambda _p, _m: ScriptedProvider(echo_script),
                    tools=builtin_registry(), config=SessionConfig("scripted", "scripted-1"))
    for session in ("mig-a", "mig-b", "mig-c"):
        for n in range(2):
            driver.submit(FollowUp(session, f"{session}-m{n}", ({"type": "text",
                                                                  "text": f"hi {n}"},)))
            await driver.drain()
    assert isinstance(driver.sink, MemorySink)
    logs = {s: list(events) for s, events in driver.sink.events.items()}
    cut = logs["mig-c"]
    driver.submit(FollowUp("mig-c", "mig-c-m2", ({"type": "text", "text": "cut"},)))
    await driver.drain()
    third = driver.sink.events["mig-c"][len(cut):]
    logs["mig-c"] = cut + third[:next(i for i, e in enumerate(third) if e.type == "step/end")]
    return logs


async def test_a_topic_without_checkpoints_is_migrated_once(
        two_partition_topics: Settings) -> None:
    settings = two_partition_topics
    logs = await _in_memory_logs()
    records = [OutRecord(settings.topics.session_events, sid.encode(), SERDE.encode(sid, e),
                         tuple(event_headers(e)), partition_of(sid))
               for sid, events in logs.items() for e in events]
    await send_records(settings, records)
    first = context(settings)
    async with driver_owning(first, PARTITIONS):
        assert first.metrics.partitions_migrated == PARTITIONS
        assert first.checkpoints.session_records_read == len(records)
        repaired = await asyncio.wait_for(wait_turns(settings, {"mig-c": 3}), 60)
        assert repaired["mig-c"][-1].data["reason"] == {"kind": "interrupted"}  # type: ignore[index]
        await follow_up(settings, "mig-a", "after the migration")
        await asyncio.wait_for(wait_turns(settings, {"mig-a": 3}), 60)
    second = context(settings)
    async with driver_owning(second, PARTITIONS):
        assert second.metrics.partitions_migrated == 0
        await follow_up(settings, "mig-b", "second start")
        found = await asyncio.wait_for(wait_turns(settings, {"mig-b": 3}), 60)
    assert second.checkpoints.session_records_read == 0
    for session in ("mig-a", "mig-b", "mig-c"):
        log = SessionLog.from_events(session, found[session])
        assert not log.turn.in_turn


@pytest.mark.timeout(600)
async def test_a_300k_event_session_costs_its_live_surface_not_its_length(
        two_partition_topics: Settings) -> None:
    """A 300,000-event session with a dsh compaction every few turns, written by older
    code: migrated once, then taken over from its checkpoint alone (no session-topic record
    read), and its next turn's model request is core's derivation of the whole log."""
    settings = two_partition_topics
    session = "long-300k"
    events = synth_session(3, 300_000)
    events = events[:max(i for i, e in enumerate(events) if e.type == "turn/end") + 1]
    assert sum(1 for e in events if e.type == "compaction/end") > 10
    async with BulkProducer(settings) as out:
        await out.send_many(settings.topics.session_events, (
            (session.encode(), SERDE.encode(session, e), list(event_headers(e)))
            for e in events), partition_of=lambda _key: partition_of(session))
        await out.flush()
    first = context(settings)
    async with driver_owning(first, PARTITIONS):
        assert first.checkpoints.session_records_read == len(events)   # the migration, once
    requests: list[ModelRequest] = []

    def recording(request: ModelRequest, attempt: int) -> ScriptedReply:
        requests.append(request)
        return echo_script(request, attempt)

    second = driver_context(settings, group_id=f"{settings.group_id_prefix}driver",
                            tools=builtin_registry(), linger_ms=10, script=recording)
    async with driver_owning(second, PARTITIONS):
        await send_records(settings, [OutRecord(  # its recorded provider: not here
            settings.topics.inbox, session.encode(), InboxCodec().encode(Configure(
                session, "to-scripted", provider="scripted", model="scripted-1")))])
        await follow_up(settings, session, "and after 300,000 events?")
        found = await asyncio.wait_for(wait_turns(
            settings, {session: ended_turns(events) + 1}), 120)
    assert second.checkpoints.session_records_read == 0
    logged = found[session]
    assert logged[:len(events)] == events
    answered = next(i for i in range(len(events), len(logged))   # the model's first words
                    if logged[i].type.startswith("assistant/"))
    assert requests and list(requests[0].messages) == list(derive_messages(logged[:answered]))
    assert len(requests[0].messages) < 200   # the live surface, not 300,000 events' worth
