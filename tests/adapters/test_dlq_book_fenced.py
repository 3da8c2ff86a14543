"""A record of the session topic is dead-lettered at most once, with two workers folding it.

Seed 22142 dead-lettered ``dsh.session-events[5]`` offset 4962 twice: a worker that lost
the partition and its new owner both met the record, and the new owner's look at the
dead-letter partition came before the old one's letter was written. Here the two workers
are two :class:`DeadLetterBook` s with the real writer and reader on the real broker, in
that order: the new owner's claim fences the old one, whose letter is then never written.
"""

from __future__ import annotations

from functools import partial

import pytest
from processors_support import fresh_settings

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.dlq_book import DeadLetterBook
from pipeline.adapters.kafka.dlq_reader import dead_lettered_offsets
from pipeline.adapters.kafka.dlq_writer import DeadLetterWriter
from pipeline.adapters.kafka.records import InboxRecord, OutRecord
from pipeline.adapters.kafka.transactional import FencedError
from pipeline.core.errors import CodecError
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.settings import Settings

pytestmark = pytest.mark.broker


async def unsent(_: OutRecord) -> None:
    raise AssertionError("with a sink, no letter goes out with the folds' outputs")


def worker_book(settings: Settings) -> tuple[DeadLetterBook, DeadLetterWriter]:
    writer = DeadLetterWriter(settings, f"{settings.topic_prefix}processors")
    book = DeadLetterBook(partial(dead_lettered_offsets, settings,
                                  settings.topics.session_events),
                          writer, counters=DeliveryCounters())
    return book, writer


def garbage(settings: Settings, offset: int) -> InboxRecord:
    return InboxRecord(settings.topics.session_events, 0, offset, b"k", b"\x00junk", ())


async def test_the_old_owner_is_fenced_and_the_new_one_skips_what_is_written(
        kafka_bootstrap: str) -> None:
    settings = fresh_settings(kafka_bootstrap, partitions=1)
    await ensure_topics(settings)
    old, old_writer = worker_book(settings)
    new, new_writer = worker_book(settings)
    try:
        old.folding(0, 10)
        await old.letter(garbage(settings, 11), CodecError("undecodable"), unsent)
        await old.write_batch(0)                    # written before the takeover
        await old.letter(garbage(settings, 12), CodecError("undecodable"), unsent)
        new.folding(0, 10)   # the new owner starts at the committed offset, 10
        # the new owner's first letter claims the partition: it fences the old one
        await new.letter(garbage(settings, 11), CodecError("undecodable"), unsent)
        await new.letter(garbage(settings, 12), CodecError("undecodable"), unsent)
        with pytest.raises(FencedError):
            await old.write_batch(0)                # the old owner's late letter
        await new.write_batch(0)
        assert new.counters.dead_letters_skipped == 1 and new.counters.dead_letters == 1
        origins = await dead_lettered_offsets(settings, settings.topics.session_events, 0, 0)
        assert origins == {11, 12}
        # Each exactly once on the topic (read committed, as every reader of it does).
        assert await _letters_per_origin(settings) == {11: 1, 12: 1}
    finally:
        await old_writer.release()
        await new_writer.release()


async def _letters_per_origin(settings: Settings) -> dict[int, int]:
    from pipeline.adapters.kafka.dlq import ORIGINAL_OFFSET
    from pipeline.adapters.kafka.records import header_value
    from pipeline.adapters.kafka.topic_scan import TopicScan

    counts: dict[int, int] = {}
    async with TopicScan(settings, settings.topics.dlq(settings.topics.session_events)) as scan:
        async for batch in scan.batches():
            for record in batch:
                offset = int(header_value(record.headers, ORIGINAL_OFFSET) or b"-1")
                counts[offset] = counts.get(offset, 0) + 1
    return counts
