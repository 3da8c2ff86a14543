"""A partition whose producer is fenced while the group still assigns it to this driver is
built again (a chaos finding, docs/chaos.md: an inbox partition nobody drove).

A fence usually means another member owns the partition in a newer generation, and this
member's next assignment says so. But a fence can come from no owner: a member's build that
its rebalance cancelled may have sent its producer's initialisation already, which reaches
the broker after the new owner's and fences it. Nothing then rebalances the group: a driver
that waited for its next assignment left the partition undriven, its commands unread.
The stale build's fence is made here by starting the partition's transactional producer,
as that build would have.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from wait_support import until

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_reader import read_session_partition
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.adapters.llm.scripted import echo_script
from pipeline.cli.cmd_driver import driver_context
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.inbox import FollowUp
from pipeline.services.driver.kafka_sink import logged_message_ids
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Settings

pytestmark = [pytest.mark.timeout(300)]
WAIT_S = 60.0  # only a failing test waits this long


async def _send_followup(settings: Settings) -> str:
    message_id = str(uuid.uuid4())
    command = FollowUp("s-fenced", message_id, ({"type": "text", "text": "hello"},))
    await send_records(settings, [OutRecord(settings.topics.inbox, b"s-fenced",
                                            InboxCodec().encode(command))])
    return message_id


async def _entered(settings: Settings, message_id: str) -> None:
    while True:
        contents = await read_session_partition(settings, settings.topics.session_events, 0,
                                                EventSerde().decode)
        if any(message_id in logged_message_ids(event)
               for events in contents.events.values() for event in events):
            return
        await asyncio.sleep(0.2)


async def test_a_partition_fenced_by_no_owner_is_built_again(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1)
    await ensure_topics(settings)
    ctx = driver_context(settings, group_id=group_id, tools=builtin_registry(), linger_ms=10,
                         script=echo_script)
    driver = DriverService(ctx, DriverConfig(linger_ms=10, session_timeout_ms=6000,
                                             shutdown_grace_s=2, rebuild_retry_s=0.5))
    stop = asyncio.Event()
    run = asyncio.create_task(driver.run(stop))
    try:
        await until(lambda: driver.ready.is_set() and 0 in driver.owned, "the driver owns 0")
        first = await _send_followup(settings)
        await asyncio.wait_for(_entered(settings, first), WAIT_S)

        stale = PartitionProducer(settings, group_id=group_id, partition=0)
        await stale.start()  # fences the driver's producer of partition 0
        await stale.close()
        second = await _send_followup(settings)  # its commit finds the driver fenced
        await until(lambda: driver.metrics.fenced >= 1, "the driver was fenced")
        try:
            await asyncio.wait_for(_entered(settings, second), WAIT_S)
        except TimeoutError:
            raise AssertionError(f"the command after the fence never entered its session; "
                                 f"the driver owns {sorted(driver.owned)}") from None
        assert not run.done()
    finally:
        stop.set()
        await asyncio.wait_for(run, WAIT_S)
