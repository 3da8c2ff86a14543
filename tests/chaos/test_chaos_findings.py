"""Defects the chaos campaign found, each reproduced deterministically (see docs/chaos.md).

A defect not yet fixed is marked ``xfail(strict=True)``: its fix makes the test pass, and the
strict mark then fails the run so that the mark is removed.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from faust.types import TP

from dsh_dev.synth import synth_header, synth_session
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.dlq import ERROR_MESSAGE, ORIGINAL_OFFSET
from pipeline.adapters.kafka.dlq_reader import dead_lettered_offsets
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import InboxRecord, OutRecord, header_value
from pipeline.adapters.kafka.topic_scan import TopicScan
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.records import event_headers
from pipeline.codec.sessionfile import write_session_file
from pipeline.core.inbox import FollowUp
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.services.processors.app import build_processors
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import SessionTables
from pipeline.services.replay.ship import Shipper
from pipeline.services.replay.topic import read_sessions
from pipeline.settings import Settings

WAIT_S = 60.0


def _open_turn_cut(seed: int) -> tuple[int, int]:
    """(a length ending mid-turn, the length of the next whole turn) of synth session ``seed``."""
    events = synth_session(seed, 400)
    ends = [n + 1 for n, e in enumerate(events) if e.type == "turn/end"]
    return ends[0] + 5, ends[1]


async def test_a_shipped_session_with_an_open_turn_keeps_one_writer(
        kafka_bootstrap: str, topic_prefix: str, group_id: str, tmp_path: Path) -> None:
    """A shipper follows a live dsh file whose last turn is open; a driver assigned the
    session's partition meanwhile (a rebalance) must not repair that turn: the shipper's
    next events would repeat the seqs of the repair. The session is the shipper's."""
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1,
                                 group_id_prefix=f"{topic_prefix}g-")
    await ensure_topics(settings)
    session_id, seed = "shipped-live", 42
    mid_turn, whole = _open_turn_cut(seed)
    events = synth_session(seed, whole)
    path = tmp_path / f"{session_id}.jsonl"
    header = {**synth_header(seed), "id": session_id}
    serde = EventSerde()
    async with Shipper(settings, tmp_path, serde.encode) as shipper:
        write_session_file(path, events[:mid_turn], header=header)  # dsh is mid-turn
        assert await shipper.pass_once() == mid_turn
        await _run_driver_until_built(settings, group_id)  # e.g. after a rebalance
        write_session_file(path, events, header=header)  # dsh goes on writing the turn
        await shipper.pass_once()
    found = await read_sessions(settings, serde.decode, only=[session_id])
    seqs = [logged.event.seq for logged in found.events[session_id]]
    assert len(seqs) == len(set(seqs)), f"seqs written twice: {len(seqs) - len(set(seqs))}"
    assert [logged.event for logged in found.events[session_id]] == events


async def _run_driver_until_built(settings: Settings, group_id: str) -> None:
    """A driver that owns the one partition, built (its crash repair done), then stopped."""
    ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(), linger_ms=10)
    service = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=2,
                                              session_timeout_ms=6000))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))

    async def built() -> None:
        while not (service.ready.is_set() and service.owned
                   and not service.health()[1]["building"]):
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(built(), WAIT_S)
        await asyncio.sleep(1.0)  # the repair's transaction commits within the linger
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def test_an_inbox_command_for_a_shipped_session_is_dead_lettered_not_run(
        kafka_bootstrap: str, topic_prefix: str, group_id: str, tmp_path: Path) -> None:
    """The driver never writes a session published from a dsh file: a follow-up for it
    goes to the inbox's dead-letter topic with the reason, and its log stays the file's."""
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1,
                                 group_id_prefix=f"{topic_prefix}g-")
    await ensure_topics(settings)
    session_id, seed = "shipped-idle", 42
    events = synth_session(seed, _open_turn_cut(seed)[1])
    write_session_file(tmp_path / f"{session_id}.jsonl", events,
                       header={**synth_header(seed), "id": session_id})
    serde = EventSerde()
    async with Shipper(settings, tmp_path, serde.encode) as shipper:
        assert await shipper.pass_once() == len(events)
    command = FollowUp(session_id, "m-1", ({"type": "text", "text": "are you there?"},))
    await send_records(settings, [OutRecord(settings.topics.inbox, session_id.encode(),
                                            InboxCodec().encode(command))])
    letters = await _run_driver_until_dead_letter(settings, group_id)
    assert [key for key, _ in letters] == [session_id.encode()]
    message = header_value(letters[0][1], ERROR_MESSAGE) or b""
    assert b"session-not-driven" in message or b"does not drive it" in message, message
    found = await read_sessions(settings, serde.decode, only=[session_id])
    assert [logged.event for logged in found.events[session_id]] == events


async def _run_driver_until_dead_letter(
        settings: Settings, group_id: str) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    """Run a driver until the inbox's dead-letter topic holds a record; its records."""
    ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(), linger_ms=10)
    service = DriverService(ctx, DriverConfig(linger_ms=10, shutdown_grace_s=2,
                                              session_timeout_ms=6000))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    consumer = AIOKafkaConsumer(settings.topics.dlq(settings.topics.inbox),
                                **client_options(settings), group_id=None,
                                isolation_level="read_committed",
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        async def first() -> list[tuple[bytes, list[tuple[str, bytes]]]]:
            while True:
                if task.done():
                    task.result()
                batch = await consumer.getmany(timeout_ms=500)
                found = [(r.key, list(r.headers)) for rs in batch.values() for r in rs]
                if found:
                    return found
        return await asyncio.wait_for(first(), WAIT_S)
    finally:
        await consumer.stop()
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def test_a_record_read_again_after_a_kill_is_not_dead_lettered_again(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """A processors worker dead-letters a garbage record and is killed before its offset
    commit; the next owner folds the partition again from the committed offset: the dead-
    letter topic still holds one dead letter for the record (the repeats the campaign saw)."""
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1,
                                 group_id_prefix=f"{topic_prefix}g-")
    await ensure_topics(settings)
    topics, serde = settings.topics, EventSerde()
    session = "dead-once"
    events = synth_session(42, 30)
    records = [OutRecord(topics.session_events, session.encode(), serde.encode(session, e),
                         tuple(event_headers(e))) for e in events[:10]]
    records.append(OutRecord(topics.session_events, b"garbage", b"\x00not avro"))
    records += [OutRecord(topics.session_events, session.encode(), serde.encode(session, e),
                          tuple(event_headers(e))) for e in events[10:]]
    await send_records(settings, records)
    found = await read_session_records(settings)
    garbage = next(r for r in found if r.key == b"garbage")

    async def fold_all(committed: int, tables: SessionTables) -> DeliveryCounters:
        """A worker's fold of the partition from ``committed`` on ``tables`` (what its
        changelogs hold), persisted."""
        counters = DeliveryCounters()

        async def send(out: OutRecord) -> object:
            await send_records(settings, [out])
            return None
        folder = SessionFolder(tables, send, serde.decode, topics,
                               f"{topic_prefix}by-model", counters,
                               dead_lettered=partial(dead_lettered_offsets, settings,
                                                     topics.session_events))
        await folder.handle_batch([r for r in found if r.offset >= committed])
        await folder.persist()
        return counters

    # dead-letters the garbage, then a kill -9 before any commit: nothing persisted
    first = await fold_all(0, SessionTables({}, {}, {}))
    tables = SessionTables({}, {}, {})
    second = await fold_all(0, tables)   # the next owner, from the same committed offset
    third = await fold_all(garbage.offset, tables)   # one after a commit below the garbage
    assert (first.dead_letters, second.dead_letters, third.dead_letters) == (1, 0, 0)
    assert (second.dead_letters_skipped, third.dead_letters_skipped) == (1, 1)
    letters = await read_dead_letters(settings)
    assert [header_value(h, ORIGINAL_OFFSET) for _k, h in letters] == [
        str(garbage.offset).encode()]


async def read_session_records(settings: Settings) -> list[InboxRecord]:
    found: list[InboxRecord] = []
    async with TopicScan(settings, settings.topics.session_events) as scan:
        async for batch in scan.batches():
            found += batch
    return found


async def read_dead_letters(settings: Settings) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    consumer = AIOKafkaConsumer(settings.topics.dlq(settings.topics.session_events),
                                **client_options(settings), group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=3000)
        return [(r.key, list(r.headers)) for rs in batch.values() for r in rs]
    finally:
        await consumer.stop()


async def test_a_recovery_seek_of_a_partition_a_rebalance_added_does_not_crash_the_worker(
        kafka_bootstrap: str, topic_prefix: str) -> None:
    """faust's table recovery reads the changelog offsets from the broker (slow while a broker
    is down), then seeks every partition of its active set; a rebalance meanwhile adds a
    partition to that set with no offset yet (faust's ``add_active``) and restarts the
    recovery. The seek of that None reached aiokafka (``ValueError: Offset must be a positive
    integer``) and crashed the worker (the campaign, seed 17). Here: the real recovery code
    and consumer thread, the rebalance's addition made directly."""
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1)
    await ensure_topics(settings)
    processors = build_processors(settings, EventSerde().decode)
    app = processors.app
    thread = app.consumer._thread   # the worker's consumer thread, started alone
    await thread.start()
    try:
        recovery = app.tables.recovery
        table = processors.tables.sessions
        recovery.add_active(table, TP(table.changelog_topic.get_topic_name(), 0))
        assert set(recovery.active_offsets.values()) == {None}   # as the rebalance left it
        await recovery._seek_offsets(app.consumer, recovery.active_tps,
                                     recovery.active_offsets, "active")
    finally:
        await thread.stop()


async def test_a_shipper_starts_and_ships_after_garbage_reached_the_session_topic(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    """The shipper's checkpoint (the highest seq per session from the record headers) met a
    garbage record without them (written straight into the topic; the processors dead-letter
    it) and every later shipper stopped at start (the campaign, seed 11)."""
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1,
                                 group_id_prefix=f"{topic_prefix}g-")
    await ensure_topics(settings)
    await send_records(settings, [
        OutRecord(settings.topics.session_events, b"garbage", b"\x00random bytes"),
        OutRecord(settings.topics.session_events, None, b"no key, no headers")])
    events = synth_session(42, _open_turn_cut(42)[1])
    write_session_file(tmp_path / "after-garbage.jsonl", events,
                       header={**synth_header(42), "id": "after-garbage"})
    serde = EventSerde()
    async with Shipper(settings, tmp_path, serde.encode) as shipper:
        assert await shipper.pass_once() == len(events)
    async with Shipper(settings, tmp_path, serde.encode) as again:   # a restart
        assert again.next_seq["after-garbage"] == len(events)
        assert await again.pass_once() == 0
    found = await read_sessions(settings, serde.decode, only=["after-garbage"])
    assert [logged.event for logged in found.events["after-garbage"]] == events
