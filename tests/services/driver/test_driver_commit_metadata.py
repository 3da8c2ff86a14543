"""A new owner's commits keep what the commit metadata it found names until it meets those
records again (a chaos finding, docs/chaos.md: inbox records dead-lettered twice).

The metadata of the inbox offset names the records dead-lettered and the cancels applied
beyond the commit point. A new owner commits before it reaches them (crash repairs, the
first records after the commit point); had that commit dropped them, an owner after it would
dead-letter the records or apply the cancels a second time.
"""

from __future__ import annotations

from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.inbox_consumer import read_committed
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.services.driver.kafka_sink import (
    InboxOffsets,
    PartitionSink,
    applied_from_metadata,
    dead_lettered_from_metadata,
)
from pipeline.settings import Settings

FOUND = '{"applied":["cancel-7"],"dead":[15]}'  # at commit point 10


def _new_owners_offsets(committed: int, metadata: str) -> InboxOffsets:
    return InboxOffsets(committed, applied_from_metadata(metadata),
                        dead_lettered_from_metadata(metadata), metadata=metadata)


async def test_a_commit_before_the_named_records_keeps_the_metadata(
        kafka_bootstrap: str, topic_prefix: str, group_id: str) -> None:
    settings = Settings.from_env({}, bootstrap_servers=kafka_bootstrap,
                                 topic_prefix=topic_prefix, partitions=1, replication_factor=1)
    await ensure_topics(settings)
    inbox, events = settings.topics.inbox, settings.topics.session_events
    previous = PartitionProducer(settings, group_id=group_id, partition=0)
    await previous.start()
    await previous.commit([], {(inbox, 0): (10, FOUND)})
    await previous.close()

    producer = PartitionProducer(settings, group_id=group_id, partition=0)
    await producer.start()  # the new owner fences, then reads the commit
    try:
        committed, metadata = await read_committed(client_options(settings), group_id,
                                                   _tp(inbox))
        assert (committed, metadata) == (10, FOUND)
        assert committed is not None
        offsets = _new_owners_offsets(committed, metadata)
        sink = PartitionSink(producer, events_topic=events, inbox_topic=inbox, partition=0,
                             encode=lambda session, event: b"", offsets=offsets,
                             on_logged=lambda session, message: None)
        # A crash repair's records commit before the owner reaches offset 10 again...
        sink.add(OutRecord(events, b"s", b"repair", (), 0))
        await sink.commit_pending()
        assert await read_committed(client_options(settings), group_id, _tp(inbox)) == (
            10, FOUND)
        # ...and records 10-14 handled: still before the dead-lettered one and the cancel.
        for offset in range(10, 15):
            offsets.start(offset)
            offsets.done(offset)
        await sink.commit_pending()
        assert await read_committed(client_options(settings), group_id, _tp(inbox)) == (
            15, FOUND)
        # Met again: the dead letter and the cancel are recognised and committed past.
        assert offsets.already_dead_lettered(15) and offsets.already_applied("cancel-7")
        offsets.start(15)
        offsets.dead_letter(15)
        offsets.start(16)
        offsets.applied_control(16, "cancel-7")
        offsets.done(16)
        await sink.commit_pending()
        assert await read_committed(client_options(settings), group_id, _tp(inbox)) == (
            17, "")
    finally:
        await producer.close()


def _tp(topic: str) -> TopicPartition:
    return TopicPartition(topic, 0)
