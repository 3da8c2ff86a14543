"""BulkProducer on the real broker: every record lands in exactly the partition Kafka's
default partitioner gives its key (aiokafka's own, asked here independently), in the order
sent, with its value (tombstones too) and headers, also past the records it keeps in
flight; the remembered partitions stay equal to the partitioner's past their bound, and are
dropped when the topic gains partitions."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions
from aiokafka.partitioner import DefaultPartitioner

from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.topic_scan import (
    BulkProducer,
    BulkRecord,
    KeyPartitions,
    TopicScan,
    ensure_topic,
)
from pipeline.settings import Settings


def _records(count: int) -> list[BulkRecord]:
    """Keys of many lengths (murmur2's tail bytes), a key repeated in between, tombstones."""
    out: list[BulkRecord] = []
    for n in range(count):
        key = f"session-{n % 97}-{'x' * (n % 7)}".encode()
        value = None if n % 50 == 49 else f"value {n}".encode()
        out.append((key, value, [("n", str(n).encode())]))
    return out


async def test_send_many_puts_each_record_where_the_default_partitioner_does(
        settings: Settings) -> None:
    topic = f"{settings.topic_prefix}bulk"
    await ensure_topic(settings, topic, compact=False)
    records = _records(25_000)  # past two windows of records in flight
    async with BulkProducer(settings) as out:
        await out.send_many(topic, records[:13_000])
        for key, value, headers in records[13_000:13_100]:  # one by one, between the batches
            await out.send(topic, key, value, headers)
        await out.send_many(topic, iter(records[13_100:]))
    assert out.sent == len(records)
    partitioner, every = DefaultPartitioner(), list(range(settings.partitions))
    expected: dict[int, list[tuple[bytes | None, bytes | None, str]]] = {}
    for key, value, headers in records:
        expected.setdefault(partitioner(key, every, every), []).append(
            (key, value, headers[0][1].decode()))
    found: dict[int, list[tuple[bytes | None, bytes | None, str]]] = {}
    async with TopicScan(settings, topic) as scan:
        async for batch in scan.batches():
            for record in batch:
                found.setdefault(record.partition, []).append(
                    (record.key, record.value, dict(record.headers)["n"].decode()))
    assert found == expected
    assert len(found) == settings.partitions  # the keys spread: the check above is no vacuous one


async def test_remembered_partitions_equal_the_partitioner_past_the_bound_and_on_growth(
        settings: Settings) -> None:
    topic = f"{settings.topic_prefix}grows"
    await ensure_topic(settings, topic, compact=False)
    partitioner = DefaultPartitioner()
    every = list(range(settings.partitions))
    more = list(range(settings.partitions + 3))
    records = _records(6_000)
    async with BulkProducer(settings) as out:
        producer = out._started()
        await producer.client._wait_on_metadata(topic)
        table = KeyPartitions(producer, topic, limit=16)
        keys = [f"k{n}".encode() for n in range(200)] * 2  # misses past the bound, then hits
        assert [table.of(k, b"v") for k in keys] == [partitioner(k, every, every) for k in keys]
        assert table.current()
        await out.send_many(topic, records[:3_000])  # still buffered when the topic grows
        admin = AIOKafkaAdminClient(**client_options(settings))
        await admin.start()
        try:
            await admin.create_partitions({topic: NewPartitions(settings.partitions + 3)})
        finally:
            await admin.close()
        await producer.client.force_metadata_update()
        assert not table.current()
        grown = KeyPartitions(producer, topic)
        assert [grown.of(k, b"v") for k in keys] == [partitioner(k, more, more) for k in keys]
        await out.send_many(topic, records[3_000:])  # the next call sees the new count
    moved = [k for k, _v, _h in records
             if partitioner(k, more, more) != partitioner(k, every, every)]
    assert moved  # the growth changed some keys' partition: the checks can fail
    expected: dict[int, list[str]] = {}
    for index, (key, _value, headers) in enumerate(records):
        count = every if index < 3_000 else more
        expected.setdefault(partitioner(key, count, count), []).append(headers[0][1].decode())
    found: dict[int, list[str]] = {}
    async with TopicScan(settings, topic) as scan:
        async for batch in scan.batches():
            for record in batch:
                found.setdefault(record.partition, []).append(dict(record.headers)["n"].decode())
    assert found == expected
