"""I/O of the projection-version pointer topic (``<prefix>projection-versions``, compacted).

Written by ``replay`` (handover requests, the active version) and by every processors worker
(registered writer, held answer); read by both and by the SDK's readers. The records and the
pure rules they follow are :mod:`pipeline.core.projection`'s; this module only moves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from pipeline.adapters.kafka.topic_scan import BulkProducer, TopicScan, ensure_topic
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.projection import ActivePointer, PointerState, fold_pointer_records
from pipeline.settings import Settings

DERIVED_MESSAGES: Final = "derived-messages"  # the projection versioned through the pointer


def pointer_topic(settings: Settings) -> str:
    return f"{settings.topic_prefix}projection-versions"


async def read_pointer_state(settings: Settings, projection: str = DERIVED_MESSAGES
                             ) -> PointerState:
    """The pointer topic folded (an empty state when the topic does not exist yet)."""
    records: list[tuple[bytes | None, bytes | None]] = []
    async with TopicScan(settings, pointer_topic(settings)) as scan:
        async for batch in scan.batches():
            records.extend((r.key, r.value) for r in batch)
    return fold_pointer_records(projection, records)


async def active_derived_messages(settings: Settings) -> ActivePointer:
    """The derived-messages version readers read: the last switch recorded, else version 0
    (the processors' own ``<prefix>derived-messages``)."""
    active = (await read_pointer_state(settings, DERIVED_MESSAGES)).active
    return active or ActivePointer(0, settings.topics.derived_messages)


async def write_pointer_records(settings: Settings, records: Mapping[str, JsonValue | None]
                                ) -> None:
    """Write pointer records in order and wait for them (a None value: a tombstone)."""
    await ensure_topic(settings, pointer_topic(settings), compact=True)
    async with BulkProducer(settings) as producer:
        for key, value in records.items():
            await producer.send(pointer_topic(settings), key.encode("utf-8"),
                                None if value is None else dumps_json(value).encode("utf-8"))
