"""A new owner's read of the committed inbox offset never takes a group-level error for "no
committed offset" (a chaos finding, docs/chaos.md).

On a 3-node cluster the group coordinator is one node; any other node answers the group's
offset fetch with a group-level error (NOT_COORDINATOR), which is what a driver's read gets
while the coordinator moves or loads the group's offsets after a broker was killed. The
answer then names no partition; read as "no offset", a driver would start its partition over
from the earliest offset and forget the commit metadata (dead letters and cancels already
applied), dead-lettering records again.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from dsh_dev.localstack.kafka import KafkaLocal
from pipeline.adapters.kafka.inbox_consumer import read_committed
from pipeline.core.errors import BrokerError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

TOPIC = "committed-read.inbox"
GROUP = "committed-read-driver"
METADATA = '{"dead":[5]}'


async def _commit(bootstrap: str, tp: TopicPartition, offset: int) -> int:
    """Commit ``offset`` with METADATA for GROUP; return the group coordinator's node id."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 1, 3)])
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP,
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.commit({tp: OffsetAndMetadata(offset, METADATA)})
        finally:
            await consumer.stop()
        return int(await admin.find_coordinator(GROUP))
    finally:
        await admin.close()


async def _scenario(cluster: KafkaLocal) -> None:
    tp = TopicPartition(TOPIC, 0)
    options = {"bootstrap_servers": cluster.bootstrap}
    coordinator = await _commit(cluster.bootstrap, tp, 19)
    assert await read_committed(options, GROUP, tp) == (19, METADATA)
    assert await read_committed(options, GROUP, tp, coordinator_id=coordinator) == (19, METADATA)
    others = [n.node_id for n in cluster.nodes if n.node_id != coordinator]
    for node in others:
        with pytest.raises(BrokerError, match="group-level error"):
            await read_committed(options, GROUP, tp, coordinator_id=node)
    # A group that never committed still reads as "none", from its coordinator.
    assert await read_committed(options, f"{GROUP}-new", tp) == (None, "")


def test_a_group_level_error_is_not_read_as_no_committed_offset(
        shared_cluster: KafkaLocal) -> None:
    asyncio.run(_scenario(shared_cluster))
