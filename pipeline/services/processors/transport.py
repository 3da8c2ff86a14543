"""A faust transport that hands chosen topics to their agents one fetched batch at a time.

faust turns every consumed record into a message, an event, a trip through the conductor's
queues and an ack: about 130 us of CPU per record on the project's machine, which alone caps
a worker near 7,700 records per CPU-second. Most session records are ``assistant/chunk`` and
change no table, and the rest are folded by pure code that costs far less than that. So for
the topics named in ``batched_topics`` (the session topic and the usage-by-model topic),
:class:`BatchingConsumer` turns everything one fetch returned for a partition into ONE faust
message whose ``records`` are the aiokafka records (offset = the batch's last offset); every
other topic (changelogs: recovery and standbys) goes through faust unchanged, record by
record. Table writes made while folding a batch go to the changelog partition of the batch's
partition, as faust does for any event.

**Offsets.** faust commits, per partition, the end of the run of consecutive offsets it has
seen acked, where "seen" includes offset *gaps* it recorded with ``_add_gap``. For batches
that bookkeeping is both wrong and slow: it records a gap only between two delivered
messages and not at all after a message at offset 0 (its check is ``if gap > 1 and
r_offset``), so a partition whose first fetch held offset 0 alone would never commit again
and every restart would re-deliver everything; and it rebuilds an interval tree per gap,
which grows by one interval per batch until the next commit. A batched partition's messages
are processed strictly in order by its one agent and each one stands for every offset of its
fetch, so the consumer keeps no gaps for them and commits past the run of acked batches that
starts at the committed offset (:func:`committable`): once a batch message is acked (the
agent finished the whole batch, table writes included) the commit moves past it, and not
before; a batch whose folding failed is never acked, so the commit stops before it.
**Durable before committed.** faust's commit calls ``producer.flush()`` first, but faust's
flush can return with writes still unsent: its buffer drain gives up after 0.1 s without a
send (``ProducerBuffer.flush_atmost``), and a write the buffer task took off the queue is not
yet in aiokafka's batches when aiokafka's flush looks. A kill -9 right after such a commit
loses table writes (changelogs) that the committed offset claims: a recovered table behind
its partition's commit, reported as a gap and never folded past. :class:`FlushingProducer`
tracks every write put in its buffer and its ``flush`` returns only when all of them are
acknowledged by the broker (acks=all), or raises, so nothing is committed past a lost write.

The app gets it with :func:`use_batching_transport` before any topic, table or agent exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, cast

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Producer as AIOKafkaProducer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport
from faust.types.tuples import ConsumerMessage

log = logging.getLogger(__name__)


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


class ShortPollConsumerThread(AIOKafkaConsumerThread):
    """faust's consumer thread, with the broker's fetch long-poll capped at
    ``BatchingTransport.fetch_max_wait_ms`` instead of faust's fixed 1,500 ms.

    aiokafka keeps ONE fetch in flight per broker, for the partitions that have no unread
    records. A fetch that went out for idle partitions (the usage-by-model topic, a quiet
    session partition) holds every other partition of that broker until it returns: with
    faust's 1.5 s that adds up to 1.5 s to the latency of a busy partition.
    """

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Read by the fetcher that ``start()`` creates; faust passes no way to set it.
        consumer._fetch_max_wait_ms = transport.fetch_max_wait_ms
        # faust reads committed only under its own exactly-once; the session topic is
        # written in the drivers' transactions, and an aborted one (a fenced zombie, a crash
        # mid-batch) must never be folded: its seqs are written again by the next owner.
        consumer._isolation_level = "read_committed"
        return consumer


def committable(acked: Iterable[int], firsts: dict[int, int], committed: int | None
                ) -> tuple[int | None, set[int]]:
    """The offset to commit after acked batch messages, and the acks it consumes.

    ``acked``: last offsets of acked batch messages; ``firsts``: each batch's first offset by
    its last; ``committed``: the committed offset (the next to read), None before the first
    commit. The run of batches that starts at ``committed`` and has no hole is committable:
    a batch that failed is never acked (see ``app``), so nothing after it is committed and a
    restart folds it again.
    """
    position, offset, done = committed, None, set()
    for last in sorted(set(acked)):
        first = firsts.get(last, last)
        if position is not None and first > position:
            break   # an earlier batch is still being folded, or failed
        position = offset = last + 1
        done.add(last)
    return offset, done


class BatchingConsumer(AIOKafkaConsumer):
    """faust's aiokafka consumer, delivering batched topics one batch per partition fetch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_firsts: dict[Any, dict[int, int]] = {}

    def _new_consumer_thread(self) -> Any:
        return ShortPollConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        records, active_partitions = await super()._wait_next_records(timeout)
        if not records:
            return records, active_partitions
        batched: frozenset[str] = cast(BatchingTransport, self.transport).batched_topics
        regrouped: dict[Any, list[Any]] = {}
        for tp, fetched in records.items():
            batch = tp.topic in batched and fetched
            regrouped[tp] = [RecordBatch(fetched)] if batch else fetched
        return regrouped, active_partitions

    async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
        if tp.topic not in cast(BatchingTransport, self.transport).batched_topics:
            await super()._add_gap(tp, offset_from, offset_to)

    def ack(self, message: Any) -> bool:
        """A batch message fetched before the last rebalance is never committable: faust
        acks such stale messages unprocessed (it skips them), and here one ack commits a
        whole batch."""
        if (message.topic in cast(BatchingTransport, self.transport).batched_topics
                and message.generation_id != self.app.consumer_generation_id):
            message.acked = True
            self._unacked_messages.discard(message)
            return False
        done: bool = super().ack(message)
        return done

    async def on_partitions_assigned(self, assigned: Any, generation_id: int = 0) -> None:
        self._forget_batch_acks(assigned)   # acked by the previous generation
        await super().on_partitions_assigned(assigned, generation_id)
        self._forget_batch_acks(assigned)

    def _forget_batch_acks(self, partitions: Any) -> None:
        batched = cast(BatchingTransport, self.transport).batched_topics
        for tp in partitions:
            if tp.topic in batched:
                self._acked.pop(tp, None)
                self._acked_index.pop(tp, None)
                self._batch_firsts.pop(tp, None)

    def _new_offset(self, tp: Any) -> int | None:
        """For a batched partition: the end of the run of acked batches that starts at the
        committed offset (see :func:`committable`)."""
        if tp.topic not in cast(BatchingTransport, self.transport).batched_topics:
            result: int | None = super()._new_offset(tp)
            return result
        firsts = self._batch_firsts.setdefault(tp, {})
        offset, done = committable(self._acked[tp], firsts, self._committed_offset[tp])
        if done:
            self._acked[tp] = [o for o in self._acked[tp] if o not in done]
            self._acked_index[tp].difference_update(done)
            for last in done:
                firsts.pop(last, None)
        return offset

    def _to_message(self, tp: Any, record: Any) -> Any:
        if not isinstance(record, RecordBatch):
            return super()._to_message(tp, record)
        last = record.records[-1]
        self._batch_firsts.setdefault(tp, {})[last.offset] = record.records[0].offset
        timestamp = last.timestamp / 1000.0 if last.timestamp is not None else None
        return BatchMessage(last.topic, last.partition, last.offset, timestamp,
                            last.timestamp_type, None, None, b"", None, 0, 0, tp,
                            generation_id=self.app.consumer_generation_id,
                            records=record.records)


FLUSH_SLICE_S: Final = 1.0
FLUSH_WARN_EVERY_S: Final = 30.0


class FlushingProducer(AIOKafkaProducer):
    """faust's aiokafka producer whose ``flush`` waits for every write put in its buffer
    (table changelogs go through ``send_soon``) to be acknowledged, not only for the ones
    aiokafka holds at that moment (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unacknowledged: set[asyncio.Future[Any]] = set()

    def send_soon(self, fut: Any) -> None:
        self._unacknowledged.add(fut)
        fut.add_done_callback(self._acknowledged)
        super().send_soon(fut)

    def _acknowledged(self, fut: asyncio.Future[Any]) -> None:
        # A failed write stays, so that every later flush (and commit) raises.
        if fut.cancelled() or fut.exception() is None:
            self._unacknowledged.discard(fut)

    async def flush(self) -> None:
        await super().flush()
        started = last_warning = time.monotonic()
        while self._unacknowledged:
            # Wait in slices and flush again between them: faust's buffer drain gives up
            # after 0.1 s, so writes buffered meanwhile (other agents) would otherwise wait
            # for a drain nobody starts. A failed write raises; a slow broker is logged.
            done, _pending = await asyncio.wait(list(self._unacknowledged),
                                                timeout=FLUSH_SLICE_S)
            for fut in done:
                if not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            if time.monotonic() - last_warning > FLUSH_WARN_EVERY_S:
                last_warning = time.monotonic()
                log.warning("%d table/output writes unacknowledged for %.0f s; offsets are "
                            "not committed until they are", len(self._unacknowledged),
                            last_warning - started)
            await super().flush()


class BatchingTransport(AIOKafkaTransport):
    """faust's aiokafka transport with :class:`BatchingConsumer` and
    :class:`FlushingProducer`."""

    Consumer = BatchingConsumer
    Producer = FlushingProducer

    def __init__(self, url: Any, app: Any, batched_topics: Iterable[str] = (),
                 fetch_max_wait_ms: int = 1500, **kwargs: Any) -> None:
        super().__init__(url, app, **kwargs)
        self.batched_topics = frozenset(batched_topics)
        self.fetch_max_wait_ms = fetch_max_wait_ms


def use_batching_transport(app: Any, batched_topics: Iterable[str], *,
                           fetch_max_wait_ms: int) -> None:
    """Make ``app`` consume ``batched_topics`` in batches (call before declaring topics)."""
    if getattr(app, "_transport", None) is not None:
        raise RuntimeError("the faust transport already exists: install batching first")
    app.transport = BatchingTransport(app.conf.broker_consumer, app, batched_topics,
                                      fetch_max_wait_ms)
