"""Read one session's surface events back from the session topic (read committed).

Used by the processors to answer "the messages as of event N" from the log itself, so that
their per-session state keeps no history: the read starts at the offset of the session's
first event (which the processors keep) and stops at the first event of that session past
seq N, or at the partition's end offset taken when the read starts.

Only surface records (``dsh.type`` header) of the session (record key) are decoded; a
seq seen twice (a redelivered write) is kept once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.options import client_options
from pipeline.codec.records import HEADER_SEQ, HEADER_TYPE
from pipeline.core.errors import BrokerError
from pipeline.core.events import Event
from pipeline.core.types import SURFACE_TYPES
from pipeline.settings import Settings

Decoder = Callable[[bytes], tuple[str, Event]]
_SURFACE_TYPE_BYTES = frozenset(t.encode() for t in SURFACE_TYPES)


async def read_surface_events(settings: Settings, topic: str, partition: int,
                              session_id: str, start_offset: int, last_seq: int,
                              decode: Decoder, *, timeout_s: float = 300.0) -> list[Event]:
    """The surface events of ``session_id`` with seq <= ``last_seq``, in seq order."""
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                auto_offset_reset="earliest")
    tp = TopicPartition(topic, partition)
    try:
        await asyncio.wait_for(consumer.start(), timeout_s)
        consumer.assign([tp])
        end = (await asyncio.wait_for(consumer.end_offsets([tp]), timeout_s))[tp]
        if end <= start_offset:
            return []
        consumer.seek(tp, start_offset)
        return await asyncio.wait_for(
            _read(consumer, tp, end, session_id.encode(), last_seq, decode), timeout_s)
    except TimeoutError:
        raise BrokerError(f"reading session {session_id[:80]!r} from {topic}[{partition}] "
                          f"took longer than {timeout_s:.0f}s") from None
    except KafkaError as exc:
        raise BrokerError(f"reading {topic}[{partition}] failed: "
                          f"{type(exc).__name__}: {exc}") from None
    finally:
        await consumer.stop()


async def _read(consumer: Any, tp: Any, end: int, key: bytes, last_seq: int,
                decode: Decoder) -> list[Event]:
    found: dict[int, Event] = {}
    while await consumer.position(tp) < end:
        fetched = await consumer.getmany(tp, timeout_ms=500, max_records=5000)
        for record in fetched.get(tp, ()):
            if record.offset >= end:
                return _ordered(found)
            if record.key != key or record.value is None:
                continue
            headers = dict(record.headers)
            seq, type_ = headers.get(HEADER_SEQ), headers.get(HEADER_TYPE)
            if seq is not None and seq.isdigit() and int(seq) > last_seq:
                return _ordered(found)
            if type_ is not None and type_ not in _SURFACE_TYPE_BYTES:
                continue
            _sid, event = decode(record.value)
            if event.seq > last_seq:
                return _ordered(found)
            found.setdefault(event.seq, event)
    return _ordered(found)


def _ordered(found: dict[int, Event]) -> list[Event]:
    return [found[seq] for seq in sorted(found)]
