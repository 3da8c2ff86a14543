"""The heal's reader of the log (``session_records_before``) against the real broker.

It searches back from an offset in growing windows for one session's records from a seq
on, keeps one record per seq (a redelivered write is kept once), skips other sessions and
records without a seq, and gives up past ``max_span`` with what it found.
"""

from __future__ import annotations

import pytest
from processors_support import event_records, fresh_settings, generated_sessions

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_span import record_seq, session_records_before

pytestmark = pytest.mark.broker


async def test_it_finds_the_missing_records_of_one_session_only(kafka_bootstrap: str) -> None:
    settings = fresh_settings(kafka_bootstrap, partitions=1)
    await ensure_topics(settings)
    logs = generated_sessions(3, 2, "p", ["a"], 1_800_000_000_000, max_chunks=600)
    (mine, events), (other, others) = logs.items()
    assert len(events) > 1_500   # past the first window (1,024 offsets)
    records = event_records(settings, mine, events)
    mixed: list[OutRecord] = []
    for index, record in enumerate(records):
        mixed.append(record)
        if index < len(others):
            mixed.append(event_records(settings, other, [others[index]])[0])
    mixed.insert(7, records[5])   # a redelivered write: seq 5 twice
    mixed.insert(9, OutRecord(records[0].topic, records[0].key, b"no seq header", ()))
    placed = await send_records(settings, mixed)
    last = max(i for i, r in enumerate(mixed) if r is records[-1])
    before = placed[last][1]   # the session's last record: the one that "gapped"
    found = await session_records_before(settings, settings.topics.session_events, 0, mine,
                                         3, before, max_span=1_000_000)
    assert [record_seq(r) for r in found] == list(range(3, len(events) - 1))
    assert all(r.key == mine.encode() for r in found)
    assert found[2].offset == placed[mixed.index(records[5])][1]   # its first write
    # Bounded: a span too short to reach seq 3 gives what it found, not seq 3.
    short = await session_records_before(settings, settings.topics.session_events, 0, mine,
                                         3, before, max_span=100)
    assert short and record_seq(short[0]) > 3
    assert [record_seq(r) for r in short] == list(range(record_seq(short[0]) or 0,
                                                         len(events) - 1))
