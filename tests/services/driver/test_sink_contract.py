"""One contract, every event sink: what the session runner relies on of an ``EventSink``.

The same test class runs against the in-memory sink (``MemorySink``) and against the Kafka one
(``PartitionSink`` over a real transactional producer, read back read_committed from the
broker), as eventsourcing runs one recorder suite against every persistence module:

- after ``flush(session)``, every event emitted before it is durable, unchanged and in
  emission order, whatever other sessions emitted in between;
- a flush with nothing emitted changes nothing;
- a whole runner turn through the sink leaves a log that validates strictly and derives the
  runner's own messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.adapters.llm.scripted import ScriptedProvider, tool_loop_script
from pipeline.codec.avro import EventSerde
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.kafka_sink import InboxOffsets, PartitionSink
from pipeline.services.driver.memory import MemorySink
from pipeline.services.driver.runner import EventSink, SessionRunner
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

PARTITION = 0


class SinkHarness(Protocol):
    sink: EventSink

    async def durable(self, session_id: str) -> list[Event]:
        """What is durable for ``session_id``, in order."""


def text_event(seq: int, text: str) -> Event:
    message = {"id": f"u{seq}", "role": "user", "content": [{"type": "text", "text": text}],
               "source": {"kind": "user"}}
    return Event("user/message", seq, 1_700_000_000_000 + seq, message)


class EventSinkContract:
    """The tests; a subclass provides the ``harness`` fixture."""

    async def test_flushed_events_are_durable_unchanged_and_in_order(
            self, harness: SinkHarness) -> None:
        events = [text_event(seq, f"message {seq} é ✓") for seq in range(5)]
        await harness.sink.emit("s1", events[:2])
        await harness.sink.emit("s1", events[2:])
        await harness.sink.flush("s1")
        assert await harness.durable("s1") == events

    async def test_interleaved_sessions_each_keep_their_own_order(
            self, harness: SinkHarness) -> None:
        for seq in range(4):
            await harness.sink.emit("a", [text_event(seq, f"a{seq}")])
            await harness.sink.emit("b", [text_event(seq, f"b{seq}")])
        await harness.sink.flush("a")
        await harness.sink.flush("b")
        assert [e.data["content"][0]["text"] for e in await harness.durable("a")] == [
            "a0", "a1", "a2", "a3"]
        assert [e.seq for e in await harness.durable("b")] == [0, 1, 2, 3]

    async def test_a_flush_with_nothing_emitted_changes_nothing(
            self, harness: SinkHarness) -> None:
        await harness.sink.emit("s1", [text_event(0, "only")])
        await harness.sink.flush("s1")
        await harness.sink.flush("s1")
        await harness.sink.flush("other")
        assert await harness.durable("s1") == [text_event(0, "only")]
        assert await harness.durable("other") == []

    async def test_a_runner_turn_through_the_sink_is_a_strictly_valid_log(
            self, harness: SinkHarness) -> None:
        provider = ScriptedProvider(tool_loop_script("echo", '{"text": "pong"}'))
        runner = SessionRunner(SessionLog("s1"), provider_factory=lambda _p, _m: provider,
                               tools=builtin_registry(), sink=harness.sink,
                               config=SessionConfig("scripted", "scripted-1"))
        runner.submit(FollowUp("s1", "m1", ({"type": "text", "text": "ping"},)))
        await runner.run_until_idle()
        durable = await harness.durable("s1")
        assert durable == list(runner.log.events)
        rebuilt = SessionLog.from_events("s1", durable, mode="strict")
        assert rebuilt.messages() == runner.log.messages()
        assert [m["role"] for m in rebuilt.messages()] == ["user", "assistant", "user",
                                                           "assistant"]


class MemoryHarness:
    def __init__(self) -> None:
        self.sink = MemorySink()

    async def durable(self, session_id: str) -> list[Event]:
        return list(self.sink.events.get(session_id, []))


class KafkaHarness:
    """A ``PartitionSink`` of partition 0 with its flusher running, read back from the broker."""

    def __init__(self, settings: Settings, producer: PartitionProducer) -> None:
        self.settings = settings
        self.serde = EventSerde()
        self.sink = PartitionSink(producer, events_topic=settings.topics.session_events,
                                  inbox_topic=settings.topics.inbox, partition=PARTITION,
                                  encode=self.serde.encode, offsets=InboxOffsets(0),
                                  on_logged=lambda _session, _message: None, linger_ms=5)

    async def durable(self, session_id: str) -> list[Event]:
        # A commit returns once the coordinator logged it; the partition's commit marker, and so
        # what read_committed readers see, follows shortly after: wait for it (LSO == end).
        await self._transactions_settled()
        contents = await read_session_partition(self.settings, self.settings.topics.session_events,
                                                PARTITION, self.serde.decode, timeout_s=60)
        assert contents.undecodable == []
        return contents.events.get(session_id, [])

    async def _transactions_settled(self, timeout_s: float = 30.0) -> None:
        tp = TopicPartition(self.settings.topics.session_events, PARTITION)
        committed = AIOKafkaConsumer(**client_options(self.settings),
                                     isolation_level="read_committed")
        uncommitted = AIOKafkaConsumer(**client_options(self.settings))
        await committed.start()
        await uncommitted.start()
        try:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while ((await committed.end_offsets([tp]))[tp]
                   < (await uncommitted.end_offsets([tp]))[tp]):
                assert asyncio.get_running_loop().time() < deadline, "a transaction stays open"
                await asyncio.sleep(0.05)
        finally:
            await committed.stop()
            await uncommitted.stop()


class TestMemorySink(EventSinkContract):
    @pytest.fixture
    def harness(self) -> SinkHarness:
        return MemoryHarness()


@pytest.mark.timeout(420)  # the session broker's start on a loaded machine
class TestPartitionSink(EventSinkContract):
    @pytest.fixture
    async def harness(self, settings: Settings) -> AsyncIterator[SinkHarness]:
        await ensure_topics(settings)
        producer = PartitionProducer(settings, group_id=f"g{uuid.uuid4().hex[:8]}",
                                     partition=PARTITION)
        await producer.start()
        harness = KafkaHarness(settings, producer)
        flusher = asyncio.create_task(harness.sink.run())
        try:
            yield harness
        finally:
            harness.sink.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(flusher, 30)
            await producer.close()
