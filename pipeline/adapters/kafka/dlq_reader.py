"""Which records of one source partition a dead-letter topic already holds.

A consumer that writes dead letters outside a transaction (the processors) can be killed
between a dead letter and the offset commit past its record; the next owner of the
partition reads the record again. It asks :func:`dead_lettered_offsets` once per partition
and assignment, and does not dead-letter a record twice.

The dead letters of source partition p go to partition p of the dead-letter topic (the
topics are co-partitioned), in the order their writers met the records. Each owner of p
reads from its committed offset on, so the source offsets found at the end of dlq partition p
that are at or above the committed offset are those dead-lettered since the last commit.
The read goes backwards from the end, in windows of at least ``MIN_WINDOW`` records, until
it meets a dead letter from below the committed offset (or the partition's start): the
minimum window also covers an owner that died, and a next one that died before reaching
as far.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.dlq import ORIGINAL_OFFSET, ORIGINAL_PARTITION, ORIGINAL_TOPIC
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.records import header_value
from pipeline.settings import Settings

MIN_WINDOW: Final = 256


async def dead_lettered_offsets(settings: Settings, source_topic: str, partition: int,
                                since: int, *, timeout_s: float = 30.0) -> set[int]:
    """Offsets at or above ``since`` of ``source_topic``[``partition``] that its
    dead-letter topic holds. Raises :class:`BrokerError` when the topic cannot be read."""
    # Read committed: a letter whose writer was fenced before it committed was never written.
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                isolation_level="read_committed")
    tp = TopicPartition(f"{source_topic}.dlq", partition)
    try:
        with broker_errors(f"read {tp.topic}[{partition}]", timeout_s=timeout_s):
            await asyncio.wait_for(consumer.start(), timeout_s)
            consumer.assign([tp])
            return await asyncio.wait_for(
                _scan_back(consumer, tp, source_topic, partition, since), timeout_s)
    finally:
        await consumer.stop()


async def _scan_back(consumer: Any, tp: Any, source_topic: str, partition: int,
                     since: int) -> set[int]:
    first = (await consumer.beginning_offsets([tp]))[tp]
    end = (await consumer.end_offsets([tp]))[tp]
    window = MIN_WINDOW
    while True:
        start = max(first, end - window)
        origins = await _origins(consumer, tp, start, end, source_topic, partition)
        if start == first or any(offset < since for offset in origins):
            return {offset for offset in origins if offset >= since}
        window *= 4


async def _origins(consumer: Any, tp: Any, start: int, end: int, source_topic: str,
                   partition: int) -> list[int]:
    """The source offsets of the dead letters of ``source_topic``[``partition``] in
    ``start``..``end``."""
    found: list[int] = []
    if start >= end:
        return found
    consumer.seek(tp, start)
    while await consumer.position(tp) < end:
        fetched = await consumer.getmany(tp, timeout_ms=500)
        for record in fetched.get(tp, ()):
            if record.offset >= end:
                return found
            offset = _origin_offset(record.headers or (), source_topic, partition)
            if offset is not None:
                found.append(offset)
    return found


def _origin_offset(headers: Any, source_topic: str, partition: int) -> int | None:
    topic = header_value(headers, ORIGINAL_TOPIC)
    part = header_value(headers, ORIGINAL_PARTITION)
    offset = header_value(headers, ORIGINAL_OFFSET)
    if topic != source_topic.encode() or part != str(partition).encode() or offset is None:
        return None
    return int(offset) if offset.isdigit() else None
