"""Batches of session events for a downstream consumer group that commits per partition.

:class:`EventBatches` is the SDK's :class:`EventStream` read a batch at a time (the records
the client has fetched, up to ``max_records``, or none after ``timeout_ms``), for a service
that acts on a whole batch and then commits each partition's offset where its own state says
(e.g. not past the start of a turn that has not ended). A record that cannot be decoded is
returned apart, with its raw bytes, for the caller to dead-letter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.event_stream import EventRecord, EventStream
from pipeline.adapters.kafka.records import InboxRecord, headers_of
from pipeline.core.errors import BrokerError, CodecError


@dataclass(slots=True)
class EventBatch:
    records: list[EventRecord] = field(default_factory=list)
    undecodable: list[tuple[InboxRecord, CodecError]] = field(default_factory=list)
    # the last offset fetched per partition (filtered-out records included)
    last_offsets: dict[int, int] = field(default_factory=dict)


class EventBatches(EventStream):
    """An :class:`EventStream` in a group, read with :meth:`next_batch`."""

    async def next_batch(self, *, timeout_ms: int = 200, max_records: int = 2000
                         ) -> EventBatch:
        consumer = self._consumer
        if consumer is None:
            raise BrokerError("EventBatches used before start()")
        with broker_errors(f"consume {self._topic!r}"):
            fetched = await consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        batch = EventBatch()
        for tp, raws in fetched.items():
            for raw in raws:
                batch.last_offsets[tp.partition] = raw.offset
                try:
                    record = self._record(raw)
                except CodecError as exc:
                    batch.undecodable.append((InboxRecord(
                        raw.topic, raw.partition, raw.offset, raw.key, raw.value,
                        headers_of(raw.headers), raw.timestamp or 0), exc))
                    continue
                if record is not None:
                    batch.records.append(record)
        return batch

    def assigned(self) -> set[int]:
        """The partitions this member owns now."""
        if self._consumer is None:
            return set()
        return {tp.partition for tp in self._consumer.assignment()}

    async def commit_offsets(self, offsets: Mapping[int, int]) -> None:
        """Commit ``partition -> next offset to read`` for the partitions still owned."""
        consumer = self._consumer
        if consumer is None or self._group_id is None:
            raise BrokerError("commit_offsets needs a started EventBatches with a group_id")
        owned = self.assigned()
        wanted = {TopicPartition(self._topic, p): o for p, o in offsets.items() if p in owned}
        if wanted:
            with broker_errors(f"commit offsets of {self._topic!r}"):
                await consumer.commit(wanted)
