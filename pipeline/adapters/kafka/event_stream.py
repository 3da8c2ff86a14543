"""The consumer SDK: session events from Kafka as an async iterator of decoded events.

Downstream services read the session topic through :class:`EventStream`::

    serde = EventSerde()
    async with EventStream(settings, decode=serde.decode, types={"turn/end"},
                           group_id="my-service", start=Start.COMMITTED) as stream:
        async for record in stream:
            handle(record.session_id, record.event)
            await stream.commit(record)          # at-least-once: commit after handling

Type filters are applied from the ``dsh.type`` record header, so skipped records (the many
``assistant/chunk``) are never decoded. With ``dedup=True`` a redelivered (session, seq) is
skipped and a gap raises :class:`SessionGap` (a :class:`~pipeline.core.errors.SequenceError`)
instead of being yielded past; dedup looks at the ``dsh.seq`` header of *every* record, the
filtered-out ones included, so a type filter never looks like a gap.

:func:`session_events` catches one session up from a seq without a group (it reads only the
session's partition). :func:`process_at_least_once` runs a handler per record and commits
after it, in batches: a crash redelivers at most the uncommitted records, which dedup by
(session, seq) then makes harmless for a handler that records what it applied.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from pipeline.adapters.kafka.assigned import key_partition, topic_partitions
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options, consumer_size_options
from pipeline.adapters.kafka.records import Headers, headers_of
from pipeline.codec.records import read_headers, record_key, session_id_of_key
from pipeline.core.dedup import Delivery, SeqTracker
from pipeline.core.errors import BrokerError, SequenceError
from pipeline.core.events import Event
from pipeline.settings import Settings

Decoder = Callable[[bytes], tuple[str, Event]]


class Start(Enum):
    """Where a stream starts reading each partition it is given.

    ``BEGINNING`` and ``END`` ignore committed offsets; ``COMMITTED`` resumes from the
    group's committed offset (the beginning when there is none yet). In a group, the start
    applies to the partitions of the first assignment; partitions a member gains in a later
    rebalance continue from the group's committed offsets.
    """

    BEGINNING = "earliest"
    END = "latest"
    COMMITTED = "committed"


@dataclass(frozen=True, slots=True)
class At:
    """Start at the first record whose timestamp is at or after ``epoch_ms``."""

    epoch_ms: int


@dataclass(frozen=True, slots=True)
class InSession:
    """Read the partition of ``session_id`` only (no group), from ``offset`` (e.g. where
    the session's first event lies: what a reader of one session needs)."""

    session_id: str
    offset: int


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One decoded session event and where it came from."""

    session_id: str
    event: Event
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    headers: Headers = ()


class SessionGap(SequenceError):
    """A session's seq skipped ahead in the stream (records are missing or were filtered)."""

    def __init__(self, session_id: str, *, expected: int, found: int,
                 type: str | None = None) -> None:
        super().__init__(expected=expected, found=found, type=type)
        self.session_id = session_id
        self.args = (f"session {session_id!r}: {self.args[0]}",)


def partition_for(session_id: str, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a session-id key (murmur2, positive)."""
    return key_partition(record_key(session_id), partitions)


class _Seeker(ConsumerRebalanceListener):  # type: ignore[misc]
    """Positions the partitions of the first assignment where the stream's ``start`` says."""

    def __init__(self, stream: EventStream) -> None:
        self._stream = stream
        self._positioned = False

    async def on_partitions_revoked(self, revoked: Any) -> None:
        return None

    async def on_partitions_assigned(self, assigned: Any) -> None:
        # ``start`` positions the first assignment only; partitions gained in a later
        # rebalance continue from the group's committed offsets, as any member would.
        if not self._positioned:
            self._positioned = True
            await self._stream._position(set(assigned))


class EventStream:
    """An async iterator of :class:`EventRecord` from the session topic (read committed).

    ``types``: only these event types are decoded and yielded (None: all).
    ``group_id``: a consumer group (partitions shared between members, offsets committed with
    :meth:`commit`); None reads every partition alone. ``dedup``: skip redelivered
    (session, seq) and raise :class:`SessionGap` on a gap; a session first seen mid-stream
    (any start but the beginning of an ungrouped stream) starts at the seq it is first seen.
    """

    def __init__(self, settings: Settings, *, decode: Decoder,
                 types: Collection[str] | None = None, group_id: str | None = None,
                 start: Start | At | InSession = Start.BEGINNING, dedup: bool = False,
                 topic: str | None = None) -> None:
        if group_id is not None and isinstance(start, InSession):
            raise ValueError("InSession reads one partition alone: no group_id")
        self._settings = settings
        self._decode = decode
        self._types = frozenset(types) if types is not None else None
        self._group_id = group_id
        self._start = start
        self._topic = topic or settings.topics.session_events
        self._tracker = SeqTracker() if dedup else None
        self._strict_first = start is Start.BEGINNING and group_id is None
        self._consumer: AIOKafkaConsumer | None = None
        self.skipped_duplicates = 0

    async def __aenter__(self) -> EventStream:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect and subscribe; partitions are positioned as they are assigned."""
        reset = "latest" if self._start is Start.END else "earliest"
        consumer = AIOKafkaConsumer(
            group_id=self._group_id, enable_auto_commit=False, auto_offset_reset=reset,
            isolation_level="read_committed", **client_options(self._settings),
            **consumer_size_options(self._settings))
        try:
            with broker_errors(f"consume {self._topic!r}"):
                await consumer.start()
                if self._group_id is None:
                    await self._assign_all(consumer)
                else:
                    consumer.subscribe([self._topic], listener=_Seeker(self))
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def _assign_all(self, consumer: AIOKafkaConsumer) -> None:
        partitions = await partitions_of(consumer, self._topic)
        if isinstance(self._start, InSession) and partitions:
            wanted = partition_for(self._start.session_id, len(partitions))
            partitions = [tp for tp in partitions if tp.partition == wanted]
        consumer.assign(partitions)
        self._consumer = consumer
        await self._position(set(partitions))

    async def _position(self, partitions: set[TopicPartition]) -> None:
        consumer = self._consumer
        if consumer is None or not partitions:
            return
        start = self._start
        with broker_errors(f"position on {self._topic!r}"):
            if start is Start.BEGINNING:
                await consumer.seek_to_beginning(*partitions)
            elif start is Start.END:
                await consumer.seek_to_end(*partitions)
            elif isinstance(start, InSession):
                for tp in partitions:
                    consumer.seek(tp, start.offset)
            elif isinstance(start, At):
                found = await consumer.offsets_for_times({tp: start.epoch_ms
                                                          for tp in partitions})
                ends = await consumer.end_offsets(list(partitions))
                for tp in partitions:
                    hit = found.get(tp)
                    consumer.seek(tp, hit.offset if hit is not None else ends[tp])

    async def end_offsets(self) -> dict[int, int]:
        """Partition -> its end offset now (the last stable offset: read committed), for
        every partition the stream is assigned."""
        consumer = self._require_consumer()
        partitions = list(consumer.assignment())
        with broker_errors(f"end offsets of {self._topic!r}"):
            ends = await consumer.end_offsets(partitions) if partitions else {}
        return {tp.partition: offset for tp, offset in ends.items()}

    async def positions(self) -> dict[int, int]:
        """Partition -> the offset of the next record the stream will read there (records
        skipped by the type filter or dedup count as read)."""
        consumer = self._require_consumer()
        with broker_errors(f"positions on {self._topic!r}"):
            return {tp.partition: await consumer.position(tp)
                    for tp in consumer.assignment()}

    def _require_consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise BrokerError("EventStream used before start() / async with")
        return self._consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    async def commit(self, record: EventRecord) -> None:
        """Commit the group's offset just past ``record`` (at-least-once processing)."""
        if self._consumer is None or self._group_id is None:
            raise BrokerError("commit needs a started EventStream with a group_id")
        tp = TopicPartition(record.topic, record.partition)
        with broker_errors(f"commit {tp.topic}[{tp.partition}]@{record.offset + 1}"):
            await self._consumer.commit({tp: record.offset + 1})

    def _admit(self, session_id: str, seq: int, type_: str | None) -> bool:
        """Dedup by (session, seq) before decoding; raises SessionGap on a gap."""
        tracker = self._tracker
        if tracker is None:
            return True
        if not self._strict_first and tracker.expected(session_id) == 0:
            tracker.applied(session_id, seq - 1)  # first sight of a session mid-stream
        verdict = tracker.check(session_id, seq)
        if verdict is Delivery.DUPLICATE:
            self.skipped_duplicates += 1
            return False
        if verdict is Delivery.GAP:
            raise SessionGap(session_id, expected=tracker.expected(session_id), found=seq,
                             type=type_)
        tracker.applied(session_id, seq)
        return True

    async def __aiter__(self) -> AsyncIterator[EventRecord]:
        if self._consumer is None:
            raise BrokerError("EventStream used before start() / async with")
        consumer = self._consumer
        while True:
            with broker_errors(f"consume {self._topic!r}"):
                raw = await consumer.getone()
            record = self._record(raw)
            if record is not None:
                yield record

    def _record(self, raw: Any) -> EventRecord | None:
        if raw.value is None:
            return None
        info = read_headers(raw.headers)
        wanted = self._types is None or info.type is None or info.type in self._types
        if info.seq is not None and raw.key is not None:
            if not self._admit(session_id_of_key(raw.key), info.seq, info.type):
                return None
            if not wanted:
                return None
            session_id, event = self._decode(raw.value)
        else:  # no headers (a foreign producer): decode to learn type and seq
            session_id, event = self._decode(raw.value)
            if not self._admit(session_id, event.seq, event.type):
                return None
            if self._types is not None and event.type not in self._types:
                return None
        return EventRecord(session_id, event, raw.topic, raw.partition, raw.offset,
                           raw.timestamp, headers_of(raw.headers))


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The topic's partitions, from fresh metadata of that topic alone (``partitions_for_topic``
    only knows the topics the client already tracks, which an unsubscribed consumer does not;
    the whole cluster's metadata costs every topic's size at each session page opened)."""
    with broker_errors(f"read metadata of {topic!r}"):
        ids = (await topic_partitions(consumer, [topic])).get(topic)
    if not ids:
        raise BrokerError(f"topic {topic!r} does not exist; run `dsh-pipeline broker` or "
                          "ensure the topics first")
    return [TopicPartition(topic, p) for p in sorted(ids)]


async def session_events(settings: Settings, session_id: str, *, decode: Decoder,
                         from_seq: int = 0, topic: str | None = None,
                         types: Collection[str] | None = None) -> AsyncIterator[Event]:
    """Catch one session up: its events from ``from_seq`` to the topic's current end.

    Reads only the session's partition, skips other sessions' records by key and earlier
    seqs by header, without decoding them.
    """
    async for record in session_records(settings, session_id, decode=decode,
                                        from_seq=from_seq, topic=topic, types=types):
        yield record.event


async def session_records(settings: Settings, session_id: str, *, decode: Decoder,
                          from_seq: int = 0, topic: str | None = None,
                          types: Collection[str] | None = None, from_offset: int = 0,
                          read: Callable[[int, int], None] | None = None
                          ) -> AsyncIterator[EventRecord]:
    """:func:`session_events` with where each event came from and its record headers.

    ``from_offset``: where to start in the session's partition (e.g. after the source
    position of an output value, ``source.offset + 1``: the records before it are never
    fetched). ``read(partition, offset)`` is told each record fetched, the session's or
    not (what a reader proves it did not read is what it was never handed)."""
    name = topic or settings.topics.session_events
    consumer = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_committed",
                                **client_options(settings), **consumer_size_options(settings))
    try:
        with broker_errors(f"read session {session_id!r} from {name!r}"):
            await consumer.start()
            partitions = await partitions_of(consumer, name)
            tp = partitions[partition_for(session_id, len(partitions))]
            consumer.assign([tp])
            if from_offset > 0:
                consumer.seek(tp, from_offset)
            else:
                await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp]
        wanted = _SessionFilter(record_key(session_id), from_seq, types)
        async for raw in _drain(consumer, tp, end):
            if read is not None:
                read(raw.partition, raw.offset)
            if wanted.skips(raw):
                continue
            _, event = decode(raw.value)
            if event.seq >= from_seq and (types is None or event.type in types):
                yield EventRecord(session_id, event, raw.topic, raw.partition, raw.offset,
                                  raw.timestamp, headers_of(raw.headers))
    finally:
        await consumer.stop()


@dataclass(frozen=True, slots=True)
class _SessionFilter:
    key: bytes
    from_seq: int
    types: Collection[str] | None

    def skips(self, raw: Any) -> bool:
        """True for another session's record, or one the headers show is not wanted."""
        if raw.key != self.key or raw.value is None:
            return True
        info = read_headers(raw.headers)
        if info.seq is not None and info.seq < self.from_seq:
            return True
        return self.types is not None and info.type is not None and info.type not in self.types


async def _drain(consumer: AIOKafkaConsumer, tp: TopicPartition, end: int
                 ) -> AsyncIterator[Any]:
    while True:
        with broker_errors(f"read {tp.topic}[{tp.partition}]"):
            # The position can pass the end without a record: the last offsets may be markers.
            if await consumer.position(tp) >= end:
                return
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=5000)
        for raw in batch.get(tp, []):
            if raw.offset >= end:
                return
            yield raw


Handler = Callable[[EventRecord], Awaitable[None]]


async def process_at_least_once(stream: EventStream, handler: Handler, *,
                                commit_every: int = 100, commit_after_s: float = 1.0,
                                limit: int | None = None) -> int:
    """Run ``handler`` on each record of a grouped ``stream``, committing after it.

    Offsets are committed once ``commit_every`` records were handled or ``commit_after_s``
    passed, and when the loop ends (``limit`` records handled, or an exception: then only
    what was handled is committed). Returns the number of records handled. Use with
    ``dedup=True`` so redelivered records after a rebalance are skipped.
    """
    loop = asyncio.get_running_loop()
    pending: dict[tuple[str, int], EventRecord] = {}
    handled = since_commit = 0
    last_commit = loop.time()
    try:
        async for record in stream:
            await handler(record)
            handled += 1
            since_commit += 1
            pending[(record.topic, record.partition)] = record
            if since_commit >= commit_every or loop.time() - last_commit >= commit_after_s:
                await _commit_all(stream, pending)
                last_commit, since_commit = loop.time(), 0
            if limit is not None and handled >= limit:
                break
    finally:
        await _commit_all(stream, pending)
    return handled


async def _commit_all(stream: EventStream, pending: dict[tuple[str, int], EventRecord]) -> None:
    for record in list(pending.values()):
        await stream.commit(record)
    pending.clear()
