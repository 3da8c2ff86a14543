"""A faust transport that hands the session topic to its agent one fetched batch at a time.

faust turns every consumed record into a message, an event, a trip through the conductor's
queues and an ack: about 130 us of CPU per record on the project's machine, which alone caps
a worker near 7,700 records per CPU-second. Most session records are ``assistant/chunk`` and
change no table, and the rest are folded by pure code that costs far less than that. So for
the topics named in ``batched_topics`` (the session topic), :class:`BatchingConsumer` turns
everything one fetch returned for a partition into ONE faust message whose ``records`` are
the aiokafka records (offset = the batch's last offset); every other topic (the usage-by-model
stage, changelogs during recovery) goes through faust unchanged, record by record.

**Offsets.** faust commits, per partition, the end of the run of consecutive offsets it has
seen acked, where "seen" includes offset *gaps* it recorded with ``_add_gap``. It records a
gap only between two delivered messages, and not at all when the previous one was at offset
0 (its check is ``if gap > 1 and r_offset``), so a partition whose first batch started at
offset 0 would stop committing for good, and every restart would re-deliver everything. The
consumer therefore records each batch's interior offsets (first .. last - 1) as a gap itself
before delivering the batch message: once that message is acked (the agent finished the whole
batch, table writes included) the commit moves past the batch, and not before (a gap is only
merged up to the highest acked offset). faust's commit flushes the producer first, so
everything the batch wrote (changelogs, outputs) is durable before its offsets are committed.

The app gets it with :func:`use_batching_transport` before any topic, table or agent exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport
from faust.types.tuples import ConsumerMessage


class RecordBatch:
    """The records one fetch returned for one partition of a batched topic."""

    __slots__ = ("records",)

    def __init__(self, records: Sequence[Any]) -> None:
        self.records = records


class BatchMessage(ConsumerMessage):
    """One faust message standing for a whole :class:`RecordBatch` (value empty)."""

    __slots__ = ("records",)

    def __init__(self, *args: Any, records: Sequence[Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records = records


def records_of(message: Any) -> Sequence[Any]:
    """The aiokafka records behind a faust message (one, unless it is a batch)."""
    records: Sequence[Any] | None = getattr(message, "records", None)
    return records if records is not None else (message,)


class BatchingConsumer(AIOKafkaConsumer):
    """faust's aiokafka consumer, delivering batched topics one batch per partition fetch."""

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        records, active_partitions = await super()._wait_next_records(timeout)
        if not records:
            return records, active_partitions
        batched: frozenset[str] = cast(BatchingTransport, self.transport).batched_topics
        regrouped: dict[Any, list[Any]] = {}
        for tp, fetched in records.items():
            if tp.topic in batched and fetched:
                if len(fetched) > 1:
                    # Interior offsets: committable once the batch message is acked.
                    await self._add_gap(tp, fetched[0].offset, fetched[-1].offset - 1)
                regrouped[tp] = [RecordBatch(fetched)]
            else:
                regrouped[tp] = fetched
        return regrouped, active_partitions

    def _to_message(self, tp: Any, record: Any) -> Any:
        if not isinstance(record, RecordBatch):
            return super()._to_message(tp, record)
        last = record.records[-1]
        timestamp = last.timestamp / 1000.0 if last.timestamp is not None else None
        return BatchMessage(last.topic, last.partition, last.offset, timestamp,
                            last.timestamp_type, None, None, b"", None, 0, 0, tp,
                            generation_id=self.app.consumer_generation_id,
                            records=record.records)


class BatchingTransport(AIOKafkaTransport):
    """faust's aiokafka transport with :class:`BatchingConsumer`."""

    Consumer = BatchingConsumer

    def __init__(self, url: Any, app: Any, batched_topics: Iterable[str] = (),
                 **kwargs: Any) -> None:
        super().__init__(url, app, **kwargs)
        self.batched_topics = frozenset(batched_topics)


def use_batching_transport(app: Any, batched_topics: Iterable[str]) -> None:
    """Make ``app`` consume ``batched_topics`` in batches (call before declaring topics)."""
    if getattr(app, "_transport", None) is not None:
        raise RuntimeError("the faust transport already exists: install batching first")
    app.transport = BatchingTransport(app.conf.broker_consumer, app, batched_topics)
