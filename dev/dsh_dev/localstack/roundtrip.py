"""Publish records and read exactly those back: the smoke check of a (local or remote) broker.

Used by ``dsh-pipeline demo``. End offsets are taken before publishing, so records already on
the topic (an earlier demo run against the same broker) are not read back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

POLL_MS: Final = 1_000
IDLE_POLLS_ALLOWED: Final = 30


@dataclass(frozen=True, slots=True)
class Record:
    """A record's key, value and headers (what the round trip compares)."""

    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


Progress = Callable[[str], None]


async def publish_and_read_back(settings: Settings, topic: str, records: Sequence[Record],
                                progress: Progress) -> list[Record]:
    """Send ``records`` (acks=all, idempotent) to ``topic``; return what the topic then holds
    past its previous end, in partition then offset order."""
    with broker_errors(f"publish to {topic}"):
        before = await _end_offsets(settings, topic)
        await _publish(settings, topic, records, progress)
        after = await _end_offsets(settings, topic)
        return await _read_range(settings, topic, before, after, progress)


async def _publish(settings: Settings, topic: str, records: Sequence[Record],
                   progress: Progress) -> None:
    producer = AIOKafkaProducer(**client_options(settings), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        futures = [await producer.send(topic, r.value, key=r.key, headers=list(r.headers) or None)
                   for r in records]
        for future in futures:
            await future
    finally:
        await producer.stop()
    progress(f"published {len(records)} records to {topic}")


async def _partitions(settings: Settings, topic: str) -> list[int]:
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        # Listing first: a metadata request naming a missing topic would auto-create it.
        if topic not in await admin.list_topics():
            raise BrokerError(f"topic {topic!r} does not exist (ensure the topics first)")
        described = await admin.describe_topics([topic])
        return sorted(int(p["partition"]) for p in described[0]["partitions"])
    finally:
        await admin.close()


async def _end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    partitions = await _partitions(settings, topic)
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: int(offset) for tp, offset in ends.items()}
    finally:
        await consumer.stop()


async def _read_range(settings: Settings, topic: str, start: dict[int, int],
                      end: dict[int, int], progress: Progress) -> list[Record]:
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None,
                                enable_auto_commit=False)
    await consumer.start()
    by_partition: dict[int, list[Record]] = {p: [] for p in end}
    try:
        tps = {p: TopicPartition(topic, p) for p in end if end[p] > start.get(p, 0)}
        consumer.assign(list(tps.values()))
        for p, tp in tps.items():
            consumer.seek(tp, start.get(p, 0))
        idle = 0
        while any(start.get(p, 0) + len(by_partition[p]) < end[p] for p in tps):
            batch = await consumer.getmany(timeout_ms=POLL_MS)
            idle = 0 if batch else idle + 1
            if idle > IDLE_POLLS_ALLOWED:
                raise BrokerError(f"reading {topic} back: no record for {idle} s")
            for tp, fetched in batch.items():
                by_partition[tp.partition] += [
                    Record(r.key or b"", r.value or b"", tuple(r.headers or ()))
                    for r in fetched if r.offset < end[tp.partition]]
    finally:
        await consumer.stop()
    records = [r for p in sorted(by_partition) for r in by_partition[p]]
    progress(f"read {len(records)} records back from {topic}")
    return records
