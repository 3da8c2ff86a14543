"""Whole-topic reads and bulk writes for replay, check, import and the shipper.

- :class:`TopicScan` reads every partition of a topic from the beginning up to the end offsets
  taken when it starts (read committed: the last stable offsets, once the transactions open
  then have ended: :mod:`.settled_ends`), in batches of
  :class:`~pipeline.adapters.kafka.records.InboxRecord`; ``total`` is known up front, so callers
  can show progress and an ETA. :meth:`TopicScan.client_batches` yields the client's own
  records instead (no copy: about 40% of a scan's CPU), typed by :class:`ScanRecord`.
- :func:`last_seqs` is the shipper's checkpoint: the highest ``dsh.seq`` per session key,
  from headers only (nothing is decoded; records without them are no events, passed over).
- :func:`ensure_topic` creates one topic (e.g. a versioned projection) if it is missing.
- :class:`BulkProducer` sends many records fast (idempotent, acks=all, batched), for
  rebuilding a projection; it is not transactional. :meth:`BulkProducer.send_many` queues a
  topic's records with one await, each key's partition remembered (:class:`KeyPartitions`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Final, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from pipeline.adapters.faust import private_api
from pipeline.adapters.kafka.admin import MAX_COMPACTION_LAG, OUTPUT_MAX_COMPACTION_LAG_MS
from pipeline.adapters.kafka.assigned import fetch_until, start_assigned, topic_partitions
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import (
    client_options,
    consumer_size_options,
    producer_size_options,
)
from pipeline.adapters.kafka.records import InboxRecord, inbox_record_of
from pipeline.adapters.kafka.settled_ends import SETTLE_BUDGET_S
from pipeline.codec.records import ConsumedRecord, read_headers
from pipeline.core.errors import BrokerError, CodecError
from pipeline.settings import Settings

ADMIN_TIMEOUT_MS: Final = 30_000
# Per partition and fetch: fewer round trips in a scan. A fetch response is capped at the
# client's fetch_max_bytes (default 50 MiB) and the broker's fetch.max.bytes (default 55 MiB),
# which 6 partitions' worth (48 MiB) fits; raising the client's alone would not lift the cap.
_FETCH_BYTES: Final = 8 * 1024 * 1024
# Records appended between two hand-overs of every batch, and records left unacknowledged
# after one: at most twice this many are buffered or in flight.
_IN_FLIGHT: Final = 10_000
_BATCH_BYTES: Final = 512 * 1024
KEYS_REMEMBERED: Final = 65_536  # per topic, by a BulkProducer's KeyPartitions


def scan_fetch_options(settings: Settings) -> dict[str, Any]:
    """Fetch sizes of a scan: large fetches, never below what the record limit needs."""
    options = consumer_size_options(settings)
    options["max_partition_fetch_bytes"] = max(_FETCH_BYTES, settings.max_record_bytes)
    return options


class ScanRecord(ConsumedRecord, Protocol):
    """A record as the Kafka client yields it (read-only), for readers that skip the copy
    into :class:`InboxRecord`."""

    @property
    def timestamp(self) -> int: ...


class TopicScan:
    """Every committed record of ``topic`` up to the end offsets seen at :meth:`start`."""

    def __init__(self, settings: Settings, topic: str, *, batch: int = 5000,
                 settle_s: float = SETTLE_BUDGET_S) -> None:
        """``settle_s``: how long :meth:`start` waits for the transactions open below the
        high watermarks to end (:mod:`.settled_ends`) before it takes the end offsets."""
        self.topic = topic
        self._settle_s = settle_s
        self._settings = settings
        self._batch = batch
        self._consumer: AIOKafkaConsumer | None = None
        self._ends: dict[TopicPartition, int] = {}
        self.total = 0
        self.exists = True

    async def __aenter__(self) -> TopicScan:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        started = await start_assigned(self._settings, [self.topic], what=f"scan {self.topic!r}",
                                       settle_s=self._settle_s,
                                       **scan_fetch_options(self._settings))
        self._consumer = started.consumer
        if started.missing:
            self.exists = False
            return
        starts, ends = started.starts, started.ends
        self.total = sum(ends[tp] - starts[tp] for tp in ends)
        self._ends = {tp: end for tp, end in ends.items() if end > starts[tp]}

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    async def batches(self) -> AsyncIterator[list[InboxRecord]]:
        """Batches of records, each partition in offset order, until every end is reached."""
        async for runs in self._rounds():
            out = [inbox_record_of(raw) for run in runs for raw in run]
            if out:
                yield out

    async def client_batches(self) -> AsyncIterator[Sequence[ScanRecord]]:
        """The records as the client returns them, not copied: runs of one partition's
        records in offset order (up to ``batch`` records per fetch round in all), until
        every end is reached. Read them; keep no more of them than needed."""
        async for runs in self._rounds():
            for run in runs:
                yield run

    async def _rounds(self) -> AsyncIterator[list[Sequence[ScanRecord]]]:
        """One fetch round after another: its non-empty runs, each cut at its partition's end."""
        consumer = self._consumer
        if consumer is None:
            raise BrokerError("TopicScan used before start()")
        ends = self._ends
        async for fetched in fetch_until(consumer, ends, what=f"scan {self.topic!r}",
                                         max_records=self._batch):
            runs = [_before(raws, ends.get(tp)) for tp, raws in fetched.items()]
            yield [run for run in runs if run]


def _before(raws: list[Any], end: int | None) -> Sequence[ScanRecord]:
    """``raws`` (one partition, offset order) cut at ``end``: the list itself when it all
    comes before (the common case: no copy)."""
    if end is None or not raws:
        return []
    if raws[-1].offset < end:
        return raws
    return [raw for raw in raws if raw.offset < end]




async def last_seqs(settings: Settings, topic: str, *,
                    settle_s: float = SETTLE_BUDGET_S) -> dict[str, int]:
    """Session id -> the highest seq on ``topic`` (from the ``dsh.seq`` headers only).

    A record without a key or a ``dsh.seq`` header is no session event (every writer of
    events sets both): garbage written straight into the topic, which the processors
    dead-letter. It is passed over, else one such record would stop every later shipper
    and import at start.

    Read to the end offsets once every transaction open below the high watermarks has ended
    (:mod:`.settled_ends`, at most ``settle_s``): a commit whose markers are not written yet
    would else look absent, and be written again.
    """
    found: dict[str, int] = {}
    async with TopicScan(settings, topic, settle_s=settle_s) as scan:
        async for run in scan.client_batches():  # headers read, records not kept
            for record in run:
                try:
                    seq = read_headers(record.headers).seq
                except CodecError:
                    continue
                if record.key is None or seq is None:
                    continue
                session_id = record.key.decode("utf-8", "replace")
                if seq > found.get(session_id, -1):
                    found[session_id] = seq
    return found


async def topic_exists(settings: Settings, topic: str) -> bool:
    admin = AIOKafkaAdminClient(**client_options(settings), request_timeout_ms=ADMIN_TIMEOUT_MS)
    with broker_errors(f"connect to {settings.bootstrap_servers}"):
        await admin.start()
    try:
        with broker_errors("list topics"):
            return topic in set(await admin.list_topics())
    finally:
        await admin.close()


async def never_written(settings: Settings, topic: str) -> bool:
    """Whether no record was ever written to ``topic`` (or it does not exist): every
    partition's high watermark is 0, records of open transactions counted."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_uncommitted",
                                **client_options(settings))
    try:
        with broker_errors(f"read the end offsets of {topic!r}"):
            await consumer.start()
            ids = (await topic_partitions(consumer, [topic])).get(topic) or []
            ends = await consumer.end_offsets([TopicPartition(topic, p) for p in ids])
        return all(end == 0 for end in ends.values())
    finally:
        await consumer.stop()


async def ensure_topic(settings: Settings, topic: str, *, compact: bool) -> bool:
    """Create ``topic`` (settings' partitions and replication) unless it exists.

    Returns True when this call created it. A compacted topic is for derived outputs,
    changelogs and control records, read from the beginning by whoever starts: compacted
    within the outputs' lag, as the planned outputs are; anything else is kept forever
    (``retention.ms=-1``).
    """
    configs = ({"cleanup.policy": "compact", MAX_COMPACTION_LAG: OUTPUT_MAX_COMPACTION_LAG_MS}
               if compact else {"cleanup.policy": "delete", "retention.ms": "-1"})
    configs["max.message.bytes"] = str(settings.max_record_bytes)
    admin = AIOKafkaAdminClient(**client_options(settings), request_timeout_ms=ADMIN_TIMEOUT_MS)
    with broker_errors(f"connect to {settings.bootstrap_servers}"):
        await admin.start()
    try:
        with broker_errors(f"create topic {topic!r}"):
            if topic in set(await admin.list_topics()):
                return False
            response = await admin.create_topics(
                [NewTopic(topic, settings.partitions, settings.replication_factor,
                          topic_configs=configs)], timeout_ms=ADMIN_TIMEOUT_MS)
        created = True
        for _name, code, message in (tuple(e)[:3] for e in response.topic_errors):
            if code != 0 and for_code(code) is TopicAlreadyExistsError:
                created = False   # created meanwhile by another client
            elif code != 0:
                raise BrokerError(f"create topic {topic!r}: {for_code(code).__name__}"
                                  + (f": {message}" if message else ""))
        await _wait_visible(admin, topic)
        return created
    finally:
        await admin.close()


async def _wait_visible(admin: AIOKafkaAdminClient, topic: str) -> None:
    for _ in range(100):  # metadata lags the controller for a moment after creation
        with broker_errors(f"describe topic {topic!r}"):
            described = await admin.describe_topics([topic])
        if described and described[0]["error_code"] == 0 and described[0]["partitions"]:
            return
        await asyncio.sleep(0.1)
    raise BrokerError(f"topic {topic!r} was created but does not show in the metadata")


class KeyPartitions:
    """The partition the producer's partitioner gives each key of one topic, remembered.

    A miss asks the producer's own partitioner (what ``send`` would do: murmur2 of the key,
    positive, modulo the partition count), so a remembered partition is exactly that one;
    a None key is never remembered (the partitioner picks one at random each time). At most
    ``limit`` keys are held: the memory is bounded, and the whole table is dropped when
    full. Valid while the topic has ``count`` partitions (see :meth:`current`).
    """

    __slots__ = ("_known", "_limit", "_producer", "count", "topic")

    def __init__(self, producer: AIOKafkaProducer, topic: str, *,
                 limit: int = KEYS_REMEMBERED) -> None:
        self._producer, self.topic, self._limit = producer, topic, limit
        self.count = self._partition_count()
        self._known: dict[bytes, int] = {}

    def of(self, key: bytes | None, value: bytes | None) -> int:
        """The partition of ``key``."""
        found = self._known.get(key) if key is not None else None
        if found is None:
            found = private_api.key_partition(self._producer, self.topic, key, value)
            if key is not None:
                if len(self._known) >= self._limit:
                    self._known.clear()
                self._known[key] = found
        return found

    def current(self) -> bool:
        """Whether the topic still has the partition count the table was made for."""
        return self._partition_count() == self.count

    def _partition_count(self) -> int:
        return len(self._producer.client.cluster.partitions_for_topic(self.topic) or ())


BulkRecord = tuple[bytes | None, bytes | None, Sequence[tuple[str, bytes]]]
"""(key, value, headers) of one record; a None value is a tombstone. The headers are any
sequence, not :data:`records.Headers` (a tuple): aiokafka's batch takes a list, and a list
given here goes to it without a copy."""


class BulkProducer:
    """Idempotent, batched sends (acks=all) with bounded records in flight.

    Records are appended to one batch per (topic, partition) built here, the partition chosen
    by the producer's own partitioner (:class:`KeyPartitions`), and a batch is handed to the
    producer whole when it is full, every ``_IN_FLIGHT`` records, or at :meth:`flush` and the
    end of ``async with``: nothing goes out on a timer, so a caller that waits between sends
    flushes first. After each hand-over of every batch, the oldest batches' acknowledgements
    are awaited until at most ``_IN_FLIGHT`` records are unacknowledged (a sliding window:
    the newest batches stay in flight meanwhile); :meth:`flush` awaits them all.
    :meth:`send_many` queues many records of a topic with one await, which suspends only to
    hand a full batch over or to wait for acknowledgements; appending a record is
    synchronous. Each partition's records keep their order.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._producer: AIOKafkaProducer | None = None
        self._futures: deque[tuple[Any, int]] = deque()  # (delivery, records), oldest first
        self._unacknowledged = 0
        self._batches: dict[str, dict[int, Any]] = {}  # topic -> partition -> batch builder
        self._partitions: dict[str, KeyPartitions] = {}
        self._buffered = 0
        self.sent = 0

    async def __aenter__(self) -> BulkProducer:
        producer = AIOKafkaProducer(**client_options(self._settings),
                                    **producer_size_options(self._settings),
                                    enable_idempotence=True,
                                    acks="all", linger_ms=20, max_batch_size=_BATCH_BYTES)
        with broker_errors(f"connect to {self._settings.bootstrap_servers}"):
            await producer.start()
        self._producer = producer
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        producer, self._producer = self._producer, None
        try:
            if exc is None and producer is not None:
                await self._flush_with(producer)
        finally:
            if producer is not None:
                await producer.stop()

    async def send(self, topic: str, key: bytes | None, value: bytes | None,
                   headers: Sequence[tuple[str, bytes]] = ()) -> None:
        """Queue one record (``value`` None: a tombstone); see :meth:`send_many`."""
        await self.send_many(topic, ((key, value, headers),))

    async def send_many(self, topic: str, records: Iterable[BulkRecord], *,
                        partition_of: Callable[[bytes], int] | None = None) -> None:
        """Queue ``records`` in order; waits when too many are in flight. ``partition_of``
        gives a record's partition from its key (default: the producer's partitioner)."""
        producer = self._started()
        with broker_errors(f"send to {topic!r}"):
            partitions = await self._key_partitions(topic)
            builders = self._batches.setdefault(topic, {})
            for key, value, headers in records:
                partition = (partitions.of(key, value) if partition_of is None or key is None
                             else partition_of(key))
                listed = headers if type(headers) is list else list(headers)
                builder = builders.get(partition)
                if builder is None or builder.append(timestamp=None, key=key, value=value,
                                                     headers=listed) is None:
                    await self._next_batch(producer, topic, partition, builder)
                    builders[partition].append(timestamp=None, key=key, value=value,
                                               headers=listed)  # an empty batch takes any one
                    partitions = await self._key_partitions(topic)
                self._buffered += 1
                if self._buffered >= _IN_FLIGHT:
                    await self._hand_over_all(producer)
                    await self._acknowledged(keep=_IN_FLIGHT)
                    partitions = await self._key_partitions(topic)

    def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            raise BrokerError("BulkProducer used outside `async with`")
        return self._producer

    async def _key_partitions(self, topic: str) -> KeyPartitions:
        """The topic's table, new when its partition count changed. Checked at every call
        and after every await of :meth:`send_many`: metadata changes only while the event
        loop runs, so each record gets the partition ``send`` would have given it."""
        found = self._partitions.get(topic)
        if found is None or not found.current():
            producer = self._started()
            await private_api.wait_on_metadata(producer, topic)
            found = self._partitions[topic] = KeyPartitions(producer, topic)
        return found

    async def _next_batch(self, producer: AIOKafkaProducer, topic: str, partition: int,
                          full: Any) -> None:
        """Hand ``full`` over (if any) and start the partition's next batch."""
        if full is not None:
            await self._hand_over(producer, topic, partition, full)
        self._batches[topic][partition] = producer.create_batch()

    async def _hand_over(self, producer: AIOKafkaProducer, topic: str, partition: int,
                         builder: Any) -> None:
        del self._batches[topic][partition]
        delivery = await producer.send_batch(builder, topic, partition=partition)
        self._futures.append((delivery, builder.record_count()))
        self._unacknowledged += builder.record_count()

    async def flush(self) -> None:
        """Send every buffered record and wait for its acknowledgement."""
        await self._flush_with(self._started())

    async def _flush_with(self, producer: AIOKafkaProducer) -> None:
        await self._hand_over_all(producer)
        await self._acknowledged(keep=0)

    async def _hand_over_all(self, producer: AIOKafkaProducer) -> None:
        with broker_errors("send buffered records"):
            for topic, builders in self._batches.items():
                for partition, builder in list(builders.items()):
                    await self._hand_over(producer, topic, partition, builder)
        self._buffered = 0

    async def _acknowledged(self, *, keep: int) -> None:
        """Wait for the oldest deliveries until at most ``keep`` records are unacknowledged."""
        with broker_errors("acknowledge sent records"):
            while self._futures and self._unacknowledged > keep:
                delivery, count = self._futures[0]
                await delivery
                self._futures.popleft()
                self._unacknowledged -= count
                self.sent += count
