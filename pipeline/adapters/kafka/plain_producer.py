"""A small idempotent (non-transactional) producer for one-off sends, e.g. ``dsh-pipeline send``.

Records without a partition use aiokafka's default partitioner (murmur2 of the key, the same
as the Java client), which is what keeps the inbox and the session topic co-partitioned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from aiokafka import AIOKafkaProducer

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options, producer_size_options
from pipeline.adapters.kafka.records import OutRecord, check_fits, inbox_record_limit
from pipeline.codec.inbox import InboxCodec
from pipeline.core.inbox import InboxCommand
from pipeline.settings import Settings

_INBOX_CODEC = InboxCodec()


async def send_records(settings: Settings, records: Sequence[OutRecord], *,
                       timeout_s: float = 30.0) -> list[tuple[int, int]]:
    """Send ``records`` with acks=all and wait; returns (partition, offset) of each.

    Raises :class:`RecordTooLargeError` before anything is sent when a record is above the
    record limit, or an inbox command above :func:`inbox_record_limit` (its events would
    not fit the session topic).
    """
    for record in records:
        check_size(settings, record)
    producer = AIOKafkaProducer(**client_options(settings), **producer_size_options(settings),
                                enable_idempotence=True, acks="all")
    try:
        with broker_errors(f"send {len(records)} record(s) to {settings.bootstrap_servers}",
                           timeout_s=timeout_s):
            await asyncio.wait_for(producer.start(), timeout_s)
            futures = [
                await producer.send(r.topic, r.value, key=r.key, partition=r.partition,
                                    headers=list(r.headers) or None)
                for r in records
            ]
            metas = await asyncio.wait_for(asyncio.gather(*futures), timeout_s)
    finally:
        await producer.stop()
    return [(m.partition, m.offset) for m in metas]


def check_size(settings: Settings, record: OutRecord) -> None:
    """Refuse ``record`` when it is too large for its topic (see :func:`send_records`)."""
    if record.topic == settings.topics.inbox:
        key = (record.key or b"").decode("utf-8", "replace")
        check_fits(record, inbox_record_limit(settings.max_record_bytes),
                   f"the command for session {key!r} (content included)")
    else:
        check_fits(record, settings.max_record_bytes, f"the record for {record.topic!r}")


def inbox_command_record(settings: Settings, command: InboxCommand,
                         encode: Callable[[InboxCommand], bytes] = _INBOX_CODEC.encode
                         ) -> OutRecord:
    """The inbox record of ``command``: keyed by its session, so it reaches the partition the
    session's log lives in (the inbox is co-partitioned with the session topic)."""
    return OutRecord(settings.topics.inbox, command.session_id.encode("utf-8"),
                     encode(command))
