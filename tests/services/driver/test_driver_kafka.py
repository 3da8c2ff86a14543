"""The Kafka driver against the real local broker: turns, takeover, fencing, DLQ, repair.

Each test uses its own topics (``topic_prefix``) and consumer group, runs the driver
in-process with the scripted provider, and reads the session topic back read_committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import murmur2
from driver_topics import PARTITIONS
from shared_paths import SHARED_DIR

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord, header_value
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.adapters.llm.factory import provider_from_settings
from pipeline.adapters.llm.scripted import Script, ScriptedReply, echo_script
from pipeline.adapters.registry.client import RegistryClient
from pipeline.cli.cmd_driver import driver_context
from pipeline.cli.registry_codecs import registry_codecs
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, FollowUp
from pipeline.core.log import SessionLog
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.fleet_run import followups, run_fleet
from pipeline.services.driver.kafka_sink import STEPS_PER_TRANSACTION
from pipeline.services.driver.memory import MemorySink
from pipeline.services.driver.runner import SessionRunner
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

# The timeout covers the session broker's start (conftest allows it 300 s on a loaded machine).
pytestmark = [pytest.mark.broker, pytest.mark.timeout(420)]
WAIT_S = 45.0  # only a failing test waits this long (generous for a loaded machine)
FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")


class RunningDriver:
    def __init__(self, settings: Settings, group: str, *, script: Script = echo_script,
                 config: DriverConfig | None = None, pipelined: bool = False,
                 steps_per_transaction: int = STEPS_PER_TRANSACTION) -> None:
        ctx = driver_context(settings, group_id=group, tools=builtin_registry(), linger_ms=10,
                             script=script, pipelined_flush=pipelined,
                             steps_per_transaction=steps_per_transaction)
        self.service = DriverService(ctx, config or DriverConfig(
            linger_ms=10, shutdown_grace_s=5, session_timeout_ms=6000))
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.service.run(self.stop))

    async def wait_owning(self, predicate: Callable[[set[int]], bool]) -> None:
        async def owning() -> None:
            while not (self.service.ready.is_set() and predicate(set(self.service.owned))):
                if self.task.done():
                    self.task.result()
                await asyncio.sleep(0.05)
        await asyncio.wait_for(owning(), WAIT_S)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, WAIT_S)


@contextlib.asynccontextmanager
async def running(settings: Settings, group: str, *, script: Script = echo_script,
                  config: DriverConfig | None = None, pipelined: bool = False,
                  steps_per_transaction: int = STEPS_PER_TRANSACTION
                  ) -> AsyncIterator[RunningDriver]:
    driver = RunningDriver(settings, group, script=script, config=config, pipelined=pipelined,
                           steps_per_transaction=steps_per_transaction)
    try:
        yield driver
    finally:
        if not driver.task.done():
            await driver.close()


def partition_of(session_id: str) -> int:
    return (murmur2(session_id.encode()) & 0x7FFFFFFF) % PARTITIONS


async def send_followup(settings: Settings, session_id: str, text: str) -> str:
    message_id = str(uuid.uuid4())
    command = FollowUp(session_id, message_id, ({"type": "text", "text": text},))
    record = OutRecord(settings.topics.inbox, session_id.encode(), InboxCodec().encode(command))
    await send_records(settings, [record])
    return message_id


async def session_events(settings: Settings, session_id: str) -> list[Event]:
    contents = await read_session_partition(settings, settings.topics.session_events,
                                            partition_of(session_id), EventSerde().decode)
    return contents.events.get(session_id, [])


async def wait_for_events(settings: Settings, session_id: str,
                          done: Callable[[list[Event]], bool]) -> list[Event]:
    async def poll() -> list[Event]:
        while True:
            events = await session_events(settings, session_id)
            if done(events):
                return events
            await asyncio.sleep(0.1)
    return await asyncio.wait_for(poll(), WAIT_S)


def completed_turns(events: list[Event]) -> int:
    return sum(1 for e in events
               if e.type == "turn/end" and e.data["reason"]["kind"] == "completed")


def strict_log(session_id: str, events: list[Event]) -> SessionLog:
    log = SessionLog(session_id, mode="strict")
    log.extend(events)  # raises on any duplicate, gap or invalid event
    return log


async def committed_offset(settings: Settings, group: str, partition: int) -> int | None:
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        result = await consumer.committed(TopicPartition(settings.topics.inbox, partition))
        return int(result) if result is not None else None
    finally:
        await consumer.stop()


async def wait_committed(settings: Settings, group: str, partition: int, offset: int) -> None:
    """Until ``group`` has committed ``offset`` on inbox ``partition``."""
    async def committed() -> None:
        while await committed_offset(settings, group, partition) != offset:
            await asyncio.sleep(0.1)
    await asyncio.wait_for(committed(), WAIT_S)


async def dead_owner_committed(settings: Settings, group: str, partition: int, metadata: str,
                               records: Sequence[OutRecord] = ()) -> None:
    """The last transaction of an owner of ``partition`` that died after it: ``records``, and
    the inbox offset 0 (still pending) committed with ``metadata``."""
    previous = PartitionProducer(settings, group_id=group, partition=partition)
    await previous.start()
    await previous.commit(list(records), {(settings.topics.inbox, partition): (0, metadata)})
    await previous.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["commit-per-step", "pipelined"])
async def test_followup_runs_a_complete_turn_that_validates_strictly(
        topics: Settings, group_id: str, pipelined: bool) -> None:
    session = "s-turn"
    async with running(topics, group_id, pipelined=pipelined) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        message_id = await send_followup(topics, session, "hello driver")
        events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 1)
        await driver.close()
    log = strict_log(session, events)
    types = [e.type for e in log.events]
    assert types[:3] == ["agent/inbox/spliced", "turn/start", "agent/inbox/spliced"]
    assert types[-1] == "turn/end" and "assistant/message" in types
    assert events[0].data["inserted"][0]["id"] == message_id
    assert log.messages()[0]["id"] == message_id  # the follow-up is what the model saw
    assert await committed_offset(topics, group_id, partition_of(session)) == 1
    assert driver.service.metrics.commands == 1 and driver.service.metrics.dead_letters == 0


async def test_a_burst_beyond_the_step_budget_queues_steps_and_runs_every_turn_once(
        topics: Settings, group_id: str) -> None:
    sessions = [f"s-burst-{n}" for n in range(12)]
    codec = InboxCodec()
    ids = {session: str(uuid.uuid4()) for session in sessions}
    async with running(topics, group_id, steps_per_transaction=1) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        await send_records(topics, [OutRecord(topics.topics.inbox, s.encode(), codec.encode(
            FollowUp(s, ids[s], ({"type": "text", "text": f"hello {s}"},)))) for s in sessions])
        logs = {s: await wait_for_events(topics, s, lambda ev: completed_turns(ev) == 1)
                for s in sessions}
        queued = sum(o.sink.step_budget.queued for o in driver.service.owned.values()
                     if o.sink.step_budget is not None)
        await driver.close()
    assert queued > 0  # sessions of one partition waited for a later transaction
    for session, events in logs.items():
        log = strict_log(session, events)
        inserted = [item["id"] for e in log.events if e.type == "agent/inbox/spliced"
                    for item in e.data.get("inserted", [])]
        assert inserted == [ids[session]]  # entered exactly once
        assert log.messages()[0]["id"] == ids[session]


async def test_second_driver_takes_over_without_duplicate_seqs(
        topics: Settings, group_id: str) -> None:
    session = "s-takeover"
    async with running(topics, group_id) as first:
        await first.wait_owning(lambda owned: owned == {0, 1, 2})
        await send_followup(topics, session, "turn one")
        await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 1)
        async with running(topics, group_id) as second:
            await second.wait_owning(lambda owned: len(owned) >= 1)
            await first.wait_owning(lambda owned: owned == {0, 1, 2} - set(second.service.owned))
            assert set(first.service.owned) and set(second.service.owned)  # split, disjoint
            await first.close()
            await second.wait_owning(lambda owned: owned == {0, 1, 2})
            await send_followup(topics, session, "turn two")
            events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 2)
    log = strict_log(session, events)
    assert [e.seq for e in log.events] == list(range(len(events)))
    assert [e.data["turn"] for e in events if e.type == "turn/start"] == [1, 2]


async def test_fenced_driver_gives_up_its_partition_then_builds_it_again_if_still_its(
        topics: Settings, group_id: str) -> None:
    """A fence by no owner (the stale producer below): the driver gives the partition up,
    its open transaction aborted; the group still assigns it the partition, so it builds it
    again and runs the command once."""
    session = "s-fenced"
    partition = partition_of(session)
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        built = driver.service.metrics.partitions_built
        zombie_killer = PartitionProducer(topics, group_id=group_id, partition=partition)
        await zombie_killer.start()  # same transactional id: the driver's producer is fenced
        try:
            await send_followup(topics, session, "you are fenced")

            async def given_up() -> None:
                while driver.service.metrics.fenced == 0:
                    await asyncio.sleep(0.05)
            await asyncio.wait_for(given_up(), WAIT_S)
            events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) >= 1)
            strict_log(session, events)
            assert completed_turns(events) == 1
            assert driver.service.metrics.partitions_built == built + 1
            await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        finally:
            await zombie_killer.close()


async def test_garbage_inbox_record_goes_to_dlq_and_next_command_runs(
        topics: Settings, group_id: str) -> None:
    session = "s-dlq"
    inbox = topics.topics.inbox
    traceparent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    garbage = OutRecord(inbox, session.encode(), b"\x00\x00\x00\x00\x09not avro",
                        (("traceparent", traceparent),))
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        [(partition, offset)] = await send_records(topics, [garbage])
        await send_followup(topics, session, "after the garbage")
        events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 1)
    strict_log(session, events)
    letters = await read_all(topics, topics.topics.dlq(inbox))
    assert len(letters) == 1
    key, value, headers = letters[0]
    assert key == session.encode() and value == garbage.value
    assert header_value(headers, "dsh.error.class") == b"SchemaError"
    assert b"schema id 9" in (header_value(headers, "dsh.error.message") or b"")
    assert header_value(headers, "dsh.original.topic") == inbox.encode()
    assert header_value(headers, "dsh.original.partition") == str(partition).encode()
    assert header_value(headers, "dsh.original.offset") == str(offset).encode()
    assert header_value(headers, "traceparent") == garbage.headers[0][1]


Letter = tuple[bytes, bytes, list[tuple[str, bytes]]]


async def read_all(settings: Settings, topic: str) -> list[Letter]:
    consumer = AIOKafkaConsumer(topic, **client_options(settings), group_id=None,
                                isolation_level="read_committed", auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=3000)
        return [(r.key, r.value, list(r.headers)) for records in batch.values() for r in records]
    finally:
        await consumer.stop()


async def test_open_turn_on_the_topic_is_repaired_on_assignment(
        topics: Settings, group_id: str) -> None:
    session = "s-repair"
    fixture = read_session_file(FIXTURES / "tool-outcome-unknown.jsonl").events
    open_turn = [replace(e, data=_without_placeholders(e.data, session)) for e in fixture[:5]]
    serde = EventSerde()
    await send_records(topics, [
        OutRecord(topics.topics.session_events, session.encode(), serde.encode(session, e))
        for e in open_turn])
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        events = await wait_for_events(topics, session, lambda ev: ev[-1].type == "turn/end")
        assert driver.service.metrics.turns_repaired == 1
    strict_log(session, events)
    closers = events[len(open_turn):]
    assert [e.type for e in closers] == ["tool/result", "step/end", "turn/end"]
    assert closers[0].data["error"]["code"] == "TOOL_OUTCOME_UNKNOWN"
    assert closers[2].data["reason"] == {"kind": "interrupted"}
    expected = [e.type for e in fixture[5:8]]
    assert [e.type for e in closers] == expected


def _without_placeholders(data: object, session: str) -> object:
    if isinstance(data, dict):
        return {k: _without_placeholders(v, session) for k, v in data.items()}
    if isinstance(data, list):
        return [_without_placeholders(v, session) for v in data]
    if isinstance(data, str):
        return data.replace("{{sessionId}}", session)
    return data


async def scripted_events(settings: Settings, command: FollowUp) -> list[Event]:
    """What the in-memory runner writes for ``command``: the 'before the crash' log."""
    log = SessionLog(command.session_id)
    sink = MemorySink()
    runner = SessionRunner(log, provider_factory=lambda p, m: provider_from_settings(settings, p),
                           tools=builtin_registry(), sink=sink,
                           config=SessionConfig(settings.provider, settings.model))
    runner.submit(command)
    await runner.run_until_idle()
    return sink.events[command.session_id]


@pytest.mark.parametrize("cut", ["whole-turn", "mid-step"])
async def test_redelivered_command_already_in_the_log_is_not_run_again(
        topics: Settings, group_id: str, cut: str) -> None:
    """A crash after the events committed but before the inbox offset did."""
    session = f"s-redeliver-{cut}"
    command = FollowUp(session, str(uuid.uuid4()), ({"type": "text", "text": "only once"},))
    before = await scripted_events(topics, command)
    if cut == "mid-step":
        before = before[: [e.type for e in before].index("assistant/chunk") + 1]
    serde = EventSerde()
    await send_records(topics, [
        OutRecord(topics.topics.session_events, session.encode(), serde.encode(session, e))
        for e in before])
    await send_records(topics, [OutRecord(topics.topics.inbox, session.encode(),
                                          InboxCodec().encode(command))])
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        await wait_committed(topics, group_id, partition_of(session), 1)
        events = await wait_for_events(topics, session, lambda ev: ev[-1].type == "turn/end")
        assert driver.service.metrics.duplicates == 1
    log = strict_log(session, events)
    assert sum(1 for e in log.events if e.type == "turn/start") == 1
    if cut == "whole-turn":
        assert events == before
    else:
        assert events[:len(before)] == before
        assert events[-1].data["reason"] == {"kind": "interrupted"}


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body.decode()


async def test_cli_send_and_driver_process_with_graceful_sigterm(
        topics: Settings, group_id: str) -> None:
    """``dsh-pipeline driver`` as a process: ready line, a turn from ``send``, clean SIGTERM."""
    env = {**os.environ, "DSH_BOOTSTRAP_SERVERS": topics.bootstrap_servers,
           "DSH_TOPIC_PREFIX": topics.topic_prefix, "DSH_PARTITIONS": str(PARTITIONS),
           "DSH_REPLICATION_FACTOR": "1", "DSH_GROUP_ID_PREFIX": f"{group_id}-"}
    cli = [sys.executable, "-m", "pipeline.cli.main"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        status_port = probe.getsockname()[1]
    driver = await asyncio.create_subprocess_exec(
        *cli, "driver", "--grace", "5", "--metrics-host", "127.0.0.1", "--metrics-port",
        str(status_port), env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        assert driver.stdout is not None
        ready = await asyncio.wait_for(driver.stdout.readline(), WAIT_S)
        assert ready.startswith(b"ready group=" + f"{group_id}-driver".encode())
        sender = await asyncio.create_subprocess_exec(
            *cli, "send", "s-cli", "--followup", "from the command line", env=env,
            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(sender.communicate(), WAIT_S)
        assert sender.returncode == 0
        sent = json.loads(out)
        assert sent["sessionId"] == "s-cli" and sent["kind"] == "followup"
        assert sent["partition"] == partition_of("s-cli")
        events = await wait_for_events(topics, "s-cli", lambda ev: completed_turns(ev) == 1)
        assert events[0].data["inserted"][0]["id"] == sent["messageId"]
        health = json.loads(await asyncio.to_thread(
            http_get, f"http://127.0.0.1:{status_port}/health"))
        assert health["status"] == "ok" and health["ready"] is True
        assert health["partitions"] == [0, 1, 2]
        metrics = await asyncio.to_thread(http_get, f"http://127.0.0.1:{status_port}/metrics")
        assert "dsh_driver_commands_total 1.0\n" in metrics
        driver.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(driver.communicate(), WAIT_S)
        assert driver.returncode == 0
        summary = json.loads(rest.splitlines()[-1])
        assert summary["stopped"] is True and summary["commands"] == 1
        assert summary["events_committed"] == len(events)
    finally:
        if driver.returncode is None:
            driver.kill()
            await driver.wait()


def slow_script(request: object, attempt: int) -> ScriptedReply:
    """A turn that streams for about 2 s (20 pieces, 100 ms apart)."""
    return ScriptedReply(text="slowly " * 20, pieces=20, chunk_delay_ms=100)


async def test_shutdown_disposes_a_running_turn_and_commits_its_command(
        topics: Settings, group_id: str) -> None:
    session = "s-dispose"
    config = DriverConfig(linger_ms=10, shutdown_grace_s=0.2, session_timeout_ms=6000)
    async with running(topics, group_id, script=slow_script, config=config) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        await send_followup(topics, session, "take your time")
        await wait_for_events(topics, session,
                              lambda ev: any(e.type == "assistant/chunk" for e in ev))
        await driver.close()
    events = await session_events(topics, session)
    strict_log(session, events)
    assert events[-1].type == "turn/end"
    assert events[-1].data["reason"] == {"kind": "aborted", "reason": {"kind": "disposed"}}
    assert await committed_offset(topics, group_id, partition_of(session)) == 1


def short_slow_script(request: object, attempt: int) -> ScriptedReply:
    return ScriptedReply(text="wait for it", delay_ms=400)


async def test_inbox_is_paused_while_too_many_turns_run_and_everything_completes(
        topics: Settings, group_id: str) -> None:
    sessions = [f"s-busy-{n}" for n in range(6)]
    config = DriverConfig(linger_ms=10, max_turns_in_flight=2, resume_below=1,
                          session_timeout_ms=6000)
    async with running(topics, group_id, script=short_slow_script, config=config) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        codec = InboxCodec()
        await send_records(topics, [
            OutRecord(topics.topics.inbox, s.encode(), codec.encode(
                FollowUp(s, str(uuid.uuid4()), ({"type": "text", "text": "go"},))))
            for s in sessions])
        for session in sessions:
            events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 1)
            strict_log(session, events)
        assert driver.service.metrics.pauses >= 1

        async def unthrottled() -> None:  # the poll loop lifts the pause on its next turn
            while driver.service.metrics_snapshot()["throttled"]:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(unthrottled(), WAIT_S)


async def test_redelivered_cancel_recorded_as_applied_in_commit_metadata_is_skipped(
        topics: Settings, group_id: str) -> None:
    """A cancel applied before a crash, its offset not committed: not applied again."""
    session = "s-cancel-once"
    partition = partition_of(session)
    codec = InboxCodec()
    cancel = Cancel(session, "cancel-before-crash")
    # The dead owner's last transaction: the cancel (offset 1) applied.
    await dead_owner_committed(topics, group_id, partition, '{"applied":["cancel-before-crash"]}')
    first = FollowUp(session, str(uuid.uuid4()), ({"type": "text", "text": "first"},))
    await send_records(topics, [
        OutRecord(topics.topics.inbox, session.encode(), codec.encode(command))
        for command in (first, cancel)])
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 1)
        await wait_committed(topics, group_id, partition, 2)
        assert driver.service.metrics.duplicates == 1
    strict_log(session, events)


async def test_redelivered_record_dead_lettered_before_a_crash_is_not_dead_lettered_again(
        topics: Settings, group_id: str) -> None:
    """Garbage dead-lettered before a crash, its offset not committed: one dead letter only."""
    session = "s-dead-once"
    partition = partition_of(session)
    first = FollowUp(session, str(uuid.uuid4()), ({"type": "text", "text": "first"},))
    await send_records(topics, [
        OutRecord(topics.topics.inbox, session.encode(), InboxCodec().encode(first)),
        OutRecord(topics.topics.inbox, session.encode(), b"\xffnot an inbox command")])
    # The dead owner's last transaction: the garbage at offset 1 dead-lettered (its dead
    # letter committed with this metadata).
    letter = OutRecord(topics.topics.dlq(topics.topics.inbox), session.encode(),
                       b"the first dead letter")
    await dead_owner_committed(topics, group_id, partition, '{"dead":[1]}', [letter])
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        events = await wait_for_events(topics, session, lambda ev: completed_turns(ev) == 1)
        await wait_committed(topics, group_id, partition, 2)
        assert driver.service.metrics.dead_letters == 0
    letters = await read_all(topics, topics.topics.dlq(topics.topics.inbox))
    assert [value for _key, value, _headers in letters] == [b"the first dead letter"]
    strict_log(session, events)


async def test_driver_with_registry_writes_confluent_framing(settings: Settings,
                                                             group_id: str) -> None:
    await ensure_topics(settings)
    session = "s-registry"
    with RegistryClient.from_settings(settings) as client:
        serde, inbox_codec = registry_codecs(settings, client)
        ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(),
                             linger_ms=10, codecs=(serde, inbox_codec))
        service = DriverService(ctx, DriverConfig(linger_ms=10, session_timeout_ms=6000))
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        try:
            await asyncio.wait_for(service.ready.wait(), WAIT_S)
            command = FollowUp(session, str(uuid.uuid4()), ({"type": "text", "text": "hi"},))
            await send_records(settings, [OutRecord(settings.topics.inbox, session.encode(),
                                                    inbox_codec.encode(command))])

            async def turn_done() -> list[Event]:
                while True:
                    found = await read_session_partition(
                        settings, settings.topics.session_events, partition_of(session),
                        serde.decode)
                    events = found.events.get(session, [])
                    if completed_turns(events) == 1:
                        return events
                    await asyncio.sleep(0.1)
            events = await asyncio.wait_for(turn_done(), WAIT_S)
        finally:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)
        strict_log(session, events)
        raw = await read_all(settings, settings.topics.session_events)
        assert raw and all(value[0] == 0 for _, value, _ in raw)  # Confluent: 0x00 + id
        assert int.from_bytes(raw[0][1][1:5], "big") == serde.schema_id


async def test_run_fleet_drives_sessions_end_to_end_and_summarises(
        topics: Settings, group_id: str) -> None:
    ctx = driver_context(topics, group_id=group_id, tools=builtin_registry(), linger_ms=10)
    sessions = [f"s-fleet-{n}" for n in range(3)]
    commands = followups(sessions, 2, lambda s, n: f"{s} turn {n}")
    seen: list[str] = []
    result = await run_fleet(ctx, commands, encode_command=InboxCodec().encode,
                             config=DriverConfig(linger_ms=10, session_timeout_ms=6000),
                             timeout_s=WAIT_S, progress=seen.append)
    summary = result.summary()
    assert summary["sessions"] == 3 and summary["turns"] == 6
    assert summary["invalid_logs"] == 0 and summary["session_failures"] == 0
    assert seen[-1] == "3/3 sessions done"
    for session in sessions:
        messages = strict_log(session, result.logs[session]).messages()
        assert [m["content"][0]["text"] for m in messages if m["role"] == "user"] == [
            f"{session} turn 0", f"{session} turn 1"]


async def test_session_whose_log_does_not_rebuild_sends_its_commands_to_the_dlq(
        topics: Settings, group_id: str) -> None:
    broken, healthy = "s-broken", "s-healthy"
    serde = EventSerde()
    gap = [Event("turn/start", 0, 1, {"turn": 1}), Event("step/start", 2, 1,
                                                          {"turn": 1, "step": 1})]
    await send_records(topics, [
        OutRecord(topics.topics.session_events, broken.encode(), serde.encode(broken, e))
        for e in gap])
    async with running(topics, group_id) as driver:
        await driver.wait_owning(lambda owned: owned == {0, 1, 2})
        await send_followup(topics, broken, "are you there?")
        await send_followup(topics, healthy, "and you?")
        events = await wait_for_events(topics, healthy, lambda ev: completed_turns(ev) == 1)
    strict_log(healthy, events)
    assert await session_events(topics, broken) == gap  # nothing appended to a broken log
    letters = await read_all(topics, topics.topics.dlq(topics.topics.inbox))
    assert [key for key, _, _ in letters] == [broken.encode()]
    message = header_value(letters[0][2], "dsh.error.message") or b""
    assert b"does not rebuild" in message and b"expected seq 1, found 2" in message
