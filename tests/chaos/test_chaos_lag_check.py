"""The campaign's lag invariant counts a group whose offsets were not read as lagging, not as
at lag 0 (a chaos finding, docs/chaos.md: an undriven inbox partition passed the check).

The admin client drops a group-level error of the group coordinator (moving, loading its
offsets) and returns no offsets; a sample then lacks that group. A group named by the campaign's
earlier samples, or by an earlier sample of the check, must be in the sample that passes.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from dsh_dev.chaos.invariants import wait_lag_zero
from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.options import client_options
from pipeline.settings import Settings


async def test_a_group_missing_from_the_sample_is_not_at_lag_0(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1)
    await ensure_topics(settings)
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=group_id,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(settings.topics.inbox, 0)
        consumer.assign([tp])
        await consumer.commit({tp: OffsetAndMetadata(0, "")})  # the empty inbox: lag 0
    finally:
        await consumer.stop()

    held, took = await wait_lag_zero(settings, budget_s=30, groups={group_id})
    assert held.ok and took is not None, held
    assert held.summary.startswith("1 groups at lag 0"), held.summary

    gone = f"{group_id}-gone"
    missing, took = await wait_lag_zero(settings, budget_s=3, groups={group_id, gone})
    assert not missing.ok and took is None, missing
    assert f"group {gone}: its offsets were not read" in missing.violations, missing
