"""The processors' session folds without a broker: tables are dicts, sends are collected.

:class:`Harness` feeds a :class:`SessionFolder` records built from events; the processors'
tests (tests/services/processors/test_processors_folding.py and its neighbours) and
tests/core/test_turn_config.py drive it.
"""

from __future__ import annotations

from typing import Any

from processors_support import generated_sessions

from pipeline.adapters.kafka.records import InboxRecord, OutRecord
from pipeline.codec.avro import EventSerde
from pipeline.codec.records import event_headers, record_key
from pipeline.core.events import Event
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.folding import SessionFolder
from pipeline.services.processors.session_state import SessionState, SessionTables
from pipeline.settings import TopicNames

TOPICS = TopicNames("t.")
SERDE = EventSerde()


class Harness:
    def __init__(self) -> None:
        self.tables = SessionTables({}, {}, {})
        self.sent: list[OutRecord] = []
        self.counters = DeliveryCounters()
        self.folder = SessionFolder(self.tables, self._send, SERDE.decode, TOPICS, "t.by-model",
                                    self.counters)
        self.offset = 0

    async def _send(self, out: OutRecord) -> None:
        self.sent.append(out)

    def record(self, session_id: str, event: Event) -> InboxRecord:
        self.offset += 1
        return InboxRecord(TOPICS.session_events, 0, self.offset, record_key(session_id),
                           SERDE.encode(session_id, event), tuple(event_headers(event)))

    async def feed(self, records: list[InboxRecord]) -> None:
        """One record per batch (as the worker sees a slow trickle), each one committed."""
        for record in records:
            await self.folder.handle(record)
            await self.folder.persist()

    async def feed_batch(self, records: list[InboxRecord]) -> None:
        """One fetched batch, then a commit (which persists what it changed)."""
        await self.folder.handle_batch(records)
        await self.folder.persist()

    def messages(self, session_id: str) -> list[Any]:
        state = SessionState.from_json(session_id, self.tables.sessions.get(session_id))
        return [self.tables.nodes[f"{session_id}/{seq}"]["message"]
                for seq in state.surface.seqs()
                if self.tables.nodes[f"{session_id}/{seq}"]["message"] is not None]

    def sent_to(self, topic: str) -> list[OutRecord]:
        return [o for o in self.sent if o.topic == topic]


def sessions(seed: int = 1, count: int = 3) -> dict[str, list[Event]]:
    return generated_sessions(seed, count, "p", ["a", "b"], 1_800_000_000_000)


def batches(records: list[InboxRecord], size: int) -> list[list[InboxRecord]]:
    return [records[i:i + size] for i in range(0, len(records), size)]
