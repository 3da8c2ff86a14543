"""Read one partition of the session topic, read_committed, up to its end.

Used by the driver on assignment of inbox partition p: sessions are co-partitioned, so
partition p of the session topic holds every event of every session the driver now owns.
"End" is the last stable offset at the time of the call (``end_offsets`` answers with the
LSO under read_committed), taken *after* the new owner fenced the old one, so no open
transaction of a previous owner can still commit below it: Kafka's contract, which a broker
restarted uncleanly has been seen to break (a transaction left hanging), so a new owner's
reads also wait for the transactions open below the high watermark (``settle_s``).

The writer mark of each session's seq-0 record is read too (``dsh.writer``, see
``codec/records.py``): a session published from a dsh file is not the driver's to write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options, consumer_size_options
from pipeline.adapters.kafka.records import header_value
from pipeline.adapters.kafka.settled_ends import settled_ends
from pipeline.codec.records import HEADER_WRITER
from pipeline.core.errors import CodecError
from pipeline.core.events import Event
from pipeline.settings import Settings

Decoder = Callable[[bytes], tuple[str, Event]]


@dataclass(slots=True)
class PartitionContents:
    """Every session's events found in one partition, in offset order."""

    partition: int
    end_offset: int = 0
    events: dict[str, list[Event]] = field(default_factory=dict)
    undecodable: list[tuple[int, str]] = field(default_factory=list)  # (offset, reason)
    records: int = 0
    writers: dict[str, str] = field(default_factory=dict)  # session id -> its marked writer


async def read_session_partition(settings: Settings, topic: str, partition: int,
                                 decode: Decoder, *, timeout_s: float = 120.0,
                                 batch: int = 5000) -> PartitionContents:
    """Read ``topic``/``partition`` from the beginning to the current LSO and decode it.

    Undecodable records are listed (offset and reason) rather than raised: the caller
    decides whether a session with a hole can be rebuilt (it cannot: its seqs would gap).
    """
    contents = PartitionContents(partition)

    def visit(record: Any) -> bool:
        contents.records += 1
        _decode_into(contents, record, decode)
        return True

    contents.end_offset = await read_committed(settings, topic, partition, visit,
                                               timeout_s=timeout_s, batch=batch)
    return contents


async def read_committed(settings: Settings, topic: str, partition: int,
                         visit: Callable[[Any], bool], *, start_offset: int | None = None,
                         what: str = "", timeout_s: float = 120.0,
                         batch: int = 5000, fetch_bytes: int | None = None,
                         read: bool = True, settle_s: float | None = None) -> int:
    """Hand ``visit`` each committed record of ``topic``/``partition`` in offset order, from
    ``start_offset`` (the beginning when None) up to the LSO taken when the read starts, until
    ``visit`` returns False. Returns that end offset.

    ``timeout_s`` bounds the start, the end-offset query and the read each; a broker failure
    or a timeout is a :class:`BrokerError` naming ``what`` (the partition by default).
    ``fetch_bytes``: a smaller fetch than the record limit's, for a read of large records
    that should not hold many at once (a broker still returns a larger record whole).
    ``read`` False: only the end offset (no record is fetched). ``settle_s``: the end is
    taken once the transactions open below the high watermark have ended
    (:mod:`.settled_ends`, waiting at most that long): a new owner's read after fencing,
    which a transaction left hanging by the broker must not cut short.
    """
    sizes = consumer_size_options(settings)
    if fetch_bytes is not None:
        sizes["max_partition_fetch_bytes"] = fetch_bytes
    consumer = AIOKafkaConsumer(**client_options(settings), **sizes,
                                group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                auto_offset_reset="earliest")
    tp = TopicPartition(topic, partition)
    what = what or f"read {topic}[{partition}]"
    try:
        with broker_errors(what, timeout_s=timeout_s):
            await asyncio.wait_for(consumer.start(), timeout_s)
            consumer.assign([tp])
            end: int = (await asyncio.wait_for(consumer.end_offsets([tp]), timeout_s))[tp]
        if settle_s is not None:
            end = (await settled_ends(settings, consumer, {tp: end}, what=what,
                                      budget_s=settle_s))[tp]
        with broker_errors(what, timeout_s=timeout_s):
            if read and end > (start_offset or 0):
                if start_offset is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, start_offset)
                await asyncio.wait_for(_read_to(consumer, tp, end, visit, batch), timeout_s)
    finally:
        await consumer.stop()
    return end


async def committed_end(settings: Settings, topic: str, partition: int, *,
                        what: str = "", settle_s: float | None = None) -> int:
    """The LSO of ``topic``/``partition`` (one past its last committed offset); no record
    is read. ``settle_s``: see :func:`read_committed`."""
    return await read_committed(settings, topic, partition, lambda _record: False, what=what,
                                read=False, settle_s=settle_s)


async def _read_to(consumer: Any, tp: Any, end: int, visit: Callable[[Any], bool],
                   batch: int) -> None:
    # The position can jump past the end: the last offsets may be transaction markers.
    while await consumer.position(tp) < end:
        fetched = await consumer.getmany(tp, timeout_ms=500, max_records=batch)
        for record in fetched.get(tp, ()):
            if record.offset >= end or not visit(record):
                return


def _decode_into(contents: PartitionContents, record: Any, decode: Decoder) -> None:
    if record.value is None:
        contents.undecodable.append((record.offset, "null value (tombstone)"))
        return
    try:
        session_id, event = decode(record.value)
    except CodecError as exc:
        contents.undecodable.append((record.offset, str(exc)))
        return
    key = record.key.decode("utf-8", "replace") if record.key is not None else session_id
    if key != session_id:
        contents.undecodable.append(
            (record.offset, f"record key {key!r} differs from the event's session {session_id!r}"))
        return
    contents.events.setdefault(session_id, []).append(event)
    if event.seq == 0:
        writer = header_value(record.headers or (), HEADER_WRITER)
        if writer is not None:
            contents.writers[session_id] = writer.decode("utf-8", "replace")
