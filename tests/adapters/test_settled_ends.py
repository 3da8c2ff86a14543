"""A checkpoint read (:func:`last_seqs`, the shipper's and import's next seqs) on the real
broker: it reads past no transaction that is still open below the high watermark. It waits
for that transaction to end and then sees its events when it commits. One still open after
the budget is a clear error that names the partition and the abort command
(:mod:`pipeline.adapters.kafka.settled_ends`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer

from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.session_reader import committed_end, read_committed
from pipeline.adapters.kafka.topic_scan import ensure_topic, last_seqs
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings


async def _send(producer: AIOKafkaProducer, topic: str, session: str, seqs: range) -> None:
    for seq in seqs:
        await producer.send_and_wait(topic, b"event", key=session.encode(), partition=0,
                                     headers=[("dsh.seq", str(seq).encode())])


@pytest.fixture
async def topic(settings: Settings) -> str:
    name = f"{settings.topic_prefix}settle-{uuid.uuid4().hex[:8]}"
    await ensure_topic(settings, name, compact=False)
    return name


@pytest.fixture
async def writer(settings: Settings) -> AsyncIterator[AIOKafkaProducer]:
    producer = AIOKafkaProducer(**client_options(settings), enable_idempotence=True,
                                transactional_id=f"settle-{uuid.uuid4().hex[:8]}")
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def _committed(producer: AIOKafkaProducer, topic: str, session: str,
                     seqs: range) -> None:
    await producer.begin_transaction()
    await _send(producer, topic, session, seqs)
    await producer.commit_transaction()


async def test_a_checkpoint_read_waits_for_an_open_transaction_and_sees_its_commit(
        settings: Settings, topic: str, writer: AIOKafkaProducer) -> None:
    await _committed(writer, topic, "s-0", range(3))
    assert await last_seqs(settings, topic) == {"s-0": 2}  # nothing open: read at once
    await writer.begin_transaction()
    await _send(writer, topic, "s-1", range(5))  # written, below the high watermark
    reading = asyncio.ensure_future(last_seqs(settings, topic))
    await asyncio.sleep(1.0)
    assert not reading.done(), f"read past an open transaction: {reading.result()}"
    await writer.commit_transaction()
    assert await asyncio.wait_for(reading, 30) == {"s-0": 2, "s-1": 4}


async def test_a_transaction_open_past_the_budget_is_a_clear_error_then_aborted_it_is_skipped(
        settings: Settings, topic: str, writer: AIOKafkaProducer) -> None:
    await _committed(writer, topic, "s-0", range(3))
    await writer.begin_transaction()
    await _send(writer, topic, "s-1", range(5))
    with pytest.raises(BrokerError) as raised:
        await last_seqs(settings, topic, settle_s=1.0)
    said = str(raised.value)
    assert f"partition {topic}[0] still has a transaction open from offset 4" in said
    assert f"abort --topic {topic} --partition 0 --start-offset 4" in said
    await writer.abort_transaction()
    assert await last_seqs(settings, topic) == {"s-0": 2}  # the aborted events are not there


async def test_a_new_owners_partition_read_waits_for_an_open_transaction_too(
        settings: Settings, topic: str, writer: AIOKafkaProducer) -> None:
    """The driver's takeover reads (``read_committed`` with ``settle_s``): the tail and the
    checkpoint scan after fencing."""
    await _committed(writer, topic, "s-0", range(3))
    assert await committed_end(settings, topic, 0, settle_s=1.0) == 4  # 3 records, a marker
    await writer.begin_transaction()
    await _send(writer, topic, "s-1", range(5))
    with pytest.raises(BrokerError, match=r"transaction open from offset 4 \(high watermark 9\)"):
        await committed_end(settings, topic, 0, what="end of session partition 0",
                            settle_s=1.0)
    seen: list[int] = []
    reading = asyncio.ensure_future(read_committed(
        settings, topic, 0, lambda record: seen.append(record.offset) is None, settle_s=30.0))
    await asyncio.sleep(1.0)
    assert not reading.done(), f"read past an open transaction, to {reading.result()}"
    await writer.commit_transaction()
    assert await asyncio.wait_for(reading, 30) == 10
    assert seen == [0, 1, 2, 4, 5, 6, 7, 8]
