"""I/O of the projection-version pointer topic (``<prefix>projection-versions``, compacted).

Written by ``replay`` (handover requests, the active version) and by every processors worker
(registered writer, held answer); read by both and by the SDK's readers. The records and the
pure rules they follow are :mod:`pipeline.core.projection`'s; this module only moves them.

:func:`read_pointer_state` reads the topic once (a consumer of its own). A reader that
reads it again and again keeps one :class:`PointerReader` open instead: starting a consumer
costs far more CPU than the fetches of one kept open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.assigned import start_assigned
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options, consumer_size_options
from pipeline.adapters.kafka.topic_scan import BulkProducer, TopicScan, ensure_topic
from pipeline.core.errors import BrokerError
from pipeline.core.events import JsonValue, dumps_json
from pipeline.core.projection import ActivePointer, Layout, PointerState, fold_pointer_records
from pipeline.settings import Settings

DERIVED_MESSAGES: Final = "derived-messages"  # the projection versioned through the pointer
PointerRecords = list[tuple[bytes | None, bytes | None]]   # (key, value), each key in order
# How long the broker holds a fetch of a PointerReader that finds nothing new (a record
# written meanwhile answers it at once), and how long aiokafka's fetch routine sleeps when
# nothing wakes it: what an idle reader costs. Offset lookups go through a second consumer,
# since a broker answers one connection's requests in order (they would wait behind the
# held fetch, see assigned.py). Below the client's request timeout (40 s).
POINTER_FETCH_WAIT_MS: Final = 10_000
# A read_to_now that has not reached the ends by then fails (the broker is unreachable).
POINTER_READ_TIMEOUT_S: Final = 30.0


def pointer_topic(settings: Settings) -> str:
    return f"{settings.topic_prefix}projection-versions"


async def read_pointer_state(settings: Settings, projection: str = DERIVED_MESSAGES
                             ) -> PointerState:
    """The pointer topic folded (an empty state when the topic does not exist yet)."""
    records: PointerRecords = []
    async with TopicScan(settings, pointer_topic(settings)) as scan:
        async for run in scan.client_batches():
            records.extend((r.key, r.value) for r in run)
    return fold_pointer_records(projection, records)


async def active_derived_messages(settings: Settings) -> ActivePointer:
    """The derived-messages version readers read: the last switch recorded, else version 0
    (the processors' own ``<prefix>derived-messages``)."""
    return (await active_derived_layout(settings))[0]


async def active_derived_layout(settings: Settings) -> tuple[ActivePointer, Layout]:
    """:func:`active_derived_messages`, and where its records lie."""
    state = await read_pointer_state(settings, DERIVED_MESSAGES)
    active = state.active or ActivePointer(0, settings.topics.derived_messages)
    return active, state.layout_of(active.topic)


async def write_pointer_records(settings: Settings, records: Mapping[str, JsonValue | None]
                                ) -> None:
    """Write pointer records in order and wait for them (a None value: a tombstone)."""
    await ensure_topic(settings, pointer_topic(settings), compact=True)
    async with BulkProducer(settings) as producer:
        await producer.send_many(pointer_topic(settings), (
            (key.encode("utf-8"), None if value is None else dumps_json(value).encode("utf-8"),
             ()) for key, value in records.items()))


class PointerReader:
    """The pointer topic through a consumer kept open (every partition assigned, no group,
    read committed, from the beginning).

    - :meth:`read_to_now` returns the records after those of the previous call (the first
      call: from the beginning) up to the end offsets (last stable offsets) listed when it
      is called; the first call uses the ends listed at :meth:`start`. So what all calls
      returned is the topic up to a cut: every record acknowledged before the last call
      began is in it, each partition in offset order, nothing twice.
    - :meth:`wait` returns once a record past what was returned is fetched, or ``wake``
      is set, or after ``timeout_s``: a follower waits there between reads.

    The end offsets are listed by a second consumer (no partitions, no fetches): its own
    connection answers at once while the reading one holds a fetch at the broker.

    One task at a time may call these (they take records from one consumer). After a
    failure the reader may have taken records it did not return: stop it and start over.
    """

    def __init__(self, settings: Settings) -> None:
        self.topic = pointer_topic(settings)
        self._settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._lookups: AIOKafkaConsumer | None = None   # lists the end offsets
        self._parts: list[TopicPartition] = []
        self._first_ends: dict[TopicPartition, int] | None = None
        self._fetched: list[Any] = []   # records taken from the consumer, not returned yet

    async def __aenter__(self) -> PointerReader:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        """Open the consumers (the topic must exist: a BrokerError otherwise)."""
        started = await start_assigned(self._settings, [self.topic],
                                       what=f"read {self.topic!r}",
                                       fetch_max_wait_ms=POINTER_FETCH_WAIT_MS,
                                       consumer_timeout_ms=POINTER_FETCH_WAIT_MS,
                                       **consumer_size_options(self._settings))
        self._consumer = started.consumer
        try:
            if started.missing:
                raise BrokerError(f"topic {self.topic!r} does not exist")
            self._lookups = AIOKafkaConsumer(enable_auto_commit=False,
                                             isolation_level="read_committed",
                                             **client_options(self._settings))
            with broker_errors(f"read {self.topic!r}"):
                await self._lookups.start()
        except BaseException:
            await self.stop()
            raise
        self._parts, self._first_ends = list(started.ends), started.ends

    async def stop(self) -> None:
        consumers = (self._consumer, self._lookups)
        self._consumer = self._lookups = None
        for consumer in consumers:
            if consumer is not None:
                await consumer.stop()

    def _clients(self) -> tuple[AIOKafkaConsumer, AIOKafkaConsumer]:
        """The reading consumer and the lookup one."""
        if self._consumer is None or self._lookups is None:
            raise BrokerError(f"PointerReader of {self.topic!r} used before start()")
        return self._consumer, self._lookups

    async def read_to_now(self) -> PointerRecords:
        """The records after those already returned, up to the end offsets listed now."""
        consumer, lookups = self._clients()
        deadline = time.monotonic() + POINTER_READ_TIMEOUT_S
        with broker_errors(f"read {self.topic!r}"):
            ends = (self._first_ends if self._first_ends is not None
                    else await lookups.end_offsets(self._parts))
            self._first_ends = None
            out: PointerRecords = []
            while True:
                later = [raw for raw in self._fetched if raw.offset >= ends[_tp(raw)]]
                out += [(raw.key, raw.value) for raw in self._fetched
                        if raw.offset < ends[_tp(raw)]]
                self._fetched = later
                behind = [tp for tp in self._parts if await consumer.position(tp) < ends[tp]]
                if not behind:
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerError(f"reading {self.topic!r} did not reach its end "
                                      f"offsets within {POINTER_READ_TIMEOUT_S:.0f} s")
                fetched = await consumer.getmany(*behind, timeout_ms=int(min(left, 1) * 1000))
                self._fetched += [raw for raws in fetched.values() for raw in raws]

    async def wait(self, timeout_s: float, wake: asyncio.Event) -> None:
        """Until a record past those returned is fetched, ``wake`` is set, or ``timeout_s``
        passed (whichever comes first)."""
        if self._fetched or wake.is_set():
            return
        consumer, _lookups = self._clients()
        fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=int(timeout_s * 1000)))
        woken = asyncio.ensure_future(wake.wait())
        try:   # a getmany cancelled while it waits has taken nothing (aiokafka)
            await asyncio.wait((fetch, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (fetch, woken):
                task.cancel()
        if fetch.done() and not fetch.cancelled():
            with broker_errors(f"read {self.topic!r}"):
                fetched = fetch.result()
            self._fetched += [raw for raws in fetched.values() for raw in raws]


def _tp(raw: Any) -> TopicPartition:  # the client's ConsumerRecord
    return TopicPartition(raw.topic, raw.partition)
