"""A ``nodes`` record the session's surface names but the worker's store lacks: the view
answers from the log (chaos seed 353762).

In that campaign a worker's RocksDB store, restored from the changelogs during rebalances,
lacked exactly one record the changelog holds (``nodes-changelog[3]`` offset 31): the
session's messages view then silently left that message out. The log is right: the view
now reads the session back from the session topic when a named node is missing, counts it
(``nodes_missing``) and logs the session.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from processors_support import event_records, fresh_settings, generated_sessions

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import InboxRecord
from pipeline.codec.avro import EventSerde
from pipeline.core.log import derive_messages
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import SessionState, SessionTables
from pipeline.services.processors.web import messages_now

pytestmark = pytest.mark.broker


async def test_a_missing_node_is_answered_from_the_log(kafka_bootstrap: str) -> None:
    settings = fresh_settings(kafka_bootstrap, partitions=1)
    await ensure_topics(settings)
    serde = EventSerde()
    (sid, events), = generated_sessions(11, 1, "p", ["a"], 1_800_000_000_000).items()
    placed = await send_records(settings, event_records(settings, sid, events, serde))
    tables = SessionTables({}, {}, {})
    counters = DeliveryCounters()

    async def send(_: object) -> None:
        return None

    folder = SessionFolder(tables, send, serde.decode, settings.topics, "by-model", counters)
    records = [InboxRecord(settings.topics.session_events, partition, offset, r.key, r.value,
                           r.headers)
               for r, (partition, offset) in zip(event_records(settings, sid, events, serde),
                                                 placed, strict=True)]
    await folder.handle_batch(records)
    await folder.persist()
    expected = list(derive_messages(events))
    processors = SimpleNamespace(tables=tables, folder=None, counters=counters,
                                 settings=settings, decode=serde.decode)
    whole = await messages_now(processors, sid)   # type: ignore[arg-type]
    assert whole is not None and whole["messages"] == expected
    assert counters.nodes_missing == 0
    surface = SessionState.from_json(sid, tables.sessions[sid]).surface.seqs()
    del tables.nodes[f"{sid}/{surface[len(surface) // 2]}"]   # what the restore lost
    answer = await messages_now(processors, sid)   # type: ignore[arg-type]
    assert answer is not None and answer["messages"] == expected
    assert answer["nextSeq"] == len(events) and counters.nodes_missing == 1
