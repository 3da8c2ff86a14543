"""A partition built across a rebalance gets every inbox record from its committed offset (a
chaos finding, docs/chaos.md: inbox commands committed past without entering their session).

While a partition builds, the poll loop drops the records fetched for it: they are fetched
again from the committed offset once the build is adopted. The poll loop blocks while the
group rebalances (aiokafka returns no records until the new assignment), so a build can
finish during a rebalance; the new assignment then fetches the partition from the group's
committed offset, and the poll that was blocked returns those records before the loop
adopts the build. Unless the adoption itself seeks, the new owner's first record lies past
the ones dropped, and its commit (first pending record, or the last one seen + 1) covers
commands that never entered their session.

The sequence is made exact with real group members: ``holder`` is slow to rejoin (its
revocation waits for the test), so the rebalance ``joiner`` starts stays open as long as the
test wants; the driver's build waits for the test before it finishes (as a build slower
than the rebalance would). Everything else is the real driver against the real broker.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition
from wait_support import until

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.inbox_consumer import read_committed
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.adapters.llm.scripted import echo_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.inbox import FollowUp
from pipeline.services.driver.kafka_sink import logged_message_ids
from pipeline.services.driver.partition import OwnedPartition, PartitionContext
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.timeout(300)]
WAIT_S = 60.0  # only a failing test waits this long
POLL_TIMEOUT_MS = 1000  # the blocked poll gets the new assignment's records within it
BEFORE = 5  # commands in the inbox before the rebalance
ENTRY_WAIT_S = 10.0  # a committed command's events become readable within this


class SlowBuildDriver(DriverService):
    """The real driver, whose partition builds finish when the test says so."""

    def __init__(self, ctx: PartitionContext, config: DriverConfig) -> None:
        super().__init__(ctx, config)
        self.builds_waiting = 0  # builds that did their work and wait to finish
        self.finish_builds = asyncio.Event()

    async def _build(self, partition: int, delay_s: float) -> OwnedPartition:
        owned = await super()._build(partition, delay_s)
        self.builds_waiting += 1
        try:
            await self.finish_builds.wait()
        except asyncio.CancelledError:
            await owned.release(grace_s=0)
            raise
        return owned


class SlowRejoin(ConsumerRebalanceListener):  # type: ignore[misc]
    """A member that rejoins a rebalance only once ``rejoin`` is set."""

    def __init__(self) -> None:
        self.rejoin = asyncio.Event()
        self.rejoin.set()
        self.waiting = asyncio.Event()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if not self.rejoin.is_set():
            self.waiting.set()
            await self.rejoin.wait()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        pass


class Revocations(logging.Handler):
    """Counts the driver's "inbox partitions revoked" lines naming a partition."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("inbox partitions revoked: [0"):
            self.count += 1


async def _member(settings: Settings, group: str, topic: str,
                  listener: ConsumerRebalanceListener | None = None) -> AIOKafkaConsumer:
    """A member of ``group`` subscribed to ``topic`` only (it takes no inbox partition)."""
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=group,
                                enable_auto_commit=False, session_timeout_ms=30_000,
                                heartbeat_interval_ms=500)
    await consumer.start()
    consumer.subscribe([topic], listener=listener or SlowRejoin())
    return consumer


async def _send_followups(settings: Settings, count: int) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    records = [OutRecord(settings.topics.inbox, f"s-{i}".encode(), InboxCodec().encode(
        FollowUp(f"s-{i}", ids[i], ({"type": "text", "text": f"hello {i}"},))))
        for i in range(count)]
    await send_records(settings, records)
    return ids


async def _committed(settings: Settings, group: str) -> int:
    offset, _ = await read_committed(client_options(settings), group,
                                     TopicPartition(settings.topics.inbox, 0))
    return offset or 0


async def _entered(settings: Settings) -> set[str]:
    contents = await read_session_partition(settings, settings.topics.session_events, 0,
                                            EventSerde().decode)
    return {message_id for events in contents.events.values() for event in events
            for message_id in logged_message_ids(event)}


async def _settings(kafka_bootstrap: str, topic_prefix: str, partitions: int) -> Settings:
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=partitions,
                                 replication_factor=1)
    await ensure_topics(settings)
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(_other_topic(settings), 1, 1)])
    finally:
        await admin.close()
    return settings


async def _not_entered(settings: Settings, ids: list[str]) -> list[int]:
    """Inbox offsets whose command is not in the session log, read until none is missing or
    ENTRY_WAIT_S passes. A transaction's commit markers reach ``__consumer_offsets`` and the
    session partition separately: the committed offset can be visible a moment before the
    events it covers are below the session partition's LSO (a CI run read that moment)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ENTRY_WAIT_S
    while True:
        entered = await _entered(settings)
        skipped = [offset for offset, message_id in enumerate(ids) if message_id not in entered]
        if not skipped or loop.time() > deadline:
            return skipped
        await asyncio.sleep(0.2)


def _other_topic(settings: Settings) -> str:
    return f"{settings.topic_prefix}other"


class Fleet:
    """The driver under test, and the holder keeping the group's next rebalance open."""

    def __init__(self, settings: Settings, group: str) -> None:
        self.settings, self.group = settings, group
        ctx = driver_context(settings, group_id=group, tools=builtin_registry(), linger_ms=10,
                             script=echo_script)
        self.driver = SlowBuildDriver(ctx, DriverConfig(linger_ms=10, session_timeout_ms=10_000,
                                                        shutdown_grace_s=2,
                                                        poll_timeout_ms=POLL_TIMEOUT_MS))
        self.holding = SlowRejoin()
        self.members: list[AIOKafkaConsumer] = []
        self.revocations = Revocations()
        self.stop = asyncio.Event()
        self.run: asyncio.Task[None] | None = None

    async def start(self, builds: int) -> None:
        """The holder joins, then the driver, which builds ``builds`` partitions (waiting)."""
        service_log.addHandler(self.revocations)
        service_log.setLevel(logging.INFO)
        self.members.append(await _member(self.settings, self.group,
                                          _other_topic(self.settings), self.holding))
        self.run = asyncio.create_task(self.driver.run(self.stop))
        await until(lambda: self.driver.builds_waiting >= builds, "the driver built")

    async def finish_builds_during_a_rebalance(self, joiner_topic: str) -> None:
        """A member joins (subscribed to ``joiner_topic``); while the rebalance is open, and
        the driver's poll waits for its outcome, the driver's builds finish."""
        self.holding.rejoin.clear()
        self.members.append(await _member(self.settings, self.group, joiner_topic))
        await until(lambda: self.revocations.count >= 1 and self.holding.waiting.is_set(),
                     "the driver and the holder are in the rebalance")
        # The poll in progress when the rebalance began ends within its timeout; the next one
        # waits for the new assignment. Only then do the builds finish.
        await asyncio.sleep(2 * POLL_TIMEOUT_MS / 1000)
        assert not self.driver.owned and self.run is not None and not self.run.done()
        self.driver.finish_builds.set()
        await until(lambda: all(t.done() for t in self.driver._building.values()),
                     "the builds finished")
        self.holding.rejoin.set()  # the group completes the rebalance

    async def close(self) -> None:
        self.stop.set()
        self.holding.rejoin.set()
        self.driver.finish_builds.set()
        if self.run is not None:
            await asyncio.wait_for(self.run, WAIT_S)
        for member in self.members:
            await member.stop()
        service_log.removeHandler(self.revocations)


service_log = logging.getLogger("pipeline.services.driver.service")


async def test_a_build_finished_during_a_rebalance_gets_every_record_after_it(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = await _settings(kafka_bootstrap, topic_prefix, 1)
    ids = await _send_followups(settings, BEFORE)  # inbox offsets 0-4, never committed
    fleet = Fleet(settings, group_id)
    try:
        await fleet.start(builds=1)
        # the joiner takes no inbox partition: the driver keeps inbox partition 0
        await fleet.finish_builds_during_a_rebalance(_other_topic(settings))
        await until(lambda: 0 in fleet.driver.owned, "the driver adopted its build")

        ids += await _send_followups(settings, 1)  # offset 5: entered by the new owner

        async def committed_past_everything() -> None:
            while await _committed(settings, group_id) < BEFORE + 1:
                await asyncio.sleep(0.1)
        await asyncio.wait_for(committed_past_everything(), WAIT_S)
        skipped = await _not_entered(settings, ids)
        assert not skipped, (f"inbox offsets {skipped} committed past (committed "
                             f"{await _committed(settings, group_id)}) but never entered")
    finally:
        await fleet.close()


async def test_a_build_finished_during_a_rebalance_that_took_its_partition_stops(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = await _settings(kafka_bootstrap, topic_prefix, 2)
    fleet = Fleet(settings, group_id)
    try:
        await fleet.start(builds=2)
        # the joiner takes one inbox partition: the driver's build of it is no longer wanted
        await fleet.finish_builds_during_a_rebalance(settings.topics.inbox)
        driver = fleet.driver
        await until(lambda: driver.ready.is_set() and len(driver.owned) == 1,
                     "the driver owns its one partition")
        await asyncio.sleep(0.5)  # a released partition's tasks end at once
        sinks = {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("sink-p")}
        assert sinks == {f"sink-p{p}" for p in driver.owned}, (
            f"sink tasks {sorted(sinks)} run, the driver owns {sorted(driver.owned)}")
    finally:
        await fleet.close()
