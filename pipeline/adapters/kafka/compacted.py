"""Snapshot, then live: the reader of the processors' compacted output topics.

:class:`CompactedFollow` assigns every partition of its topics to one consumer (no group,
read committed), takes the end offsets (the last stable offsets) once at :meth:`start`, and
then reads in two phases:

- :meth:`snapshot` yields the records from the beginning up to those ends; folded in order
  (the last value per key wins, a ``None`` value deletes the key) they give the state as of
  the ends: every key's latest value at that point, because compaction keeps at least the
  last value of every key and never reorders;
- :meth:`changes` yields every record from the ends on, forever, in offset order per
  partition: records fetched during the snapshot but past its ends come first.

**The seam.** One consumer position per partition carries from the first phase into the
second, and the split is by offset: a record below its partition's end is in the snapshot
and only there, a record at or past it is a change and only that. So no change is lost or
applied twice, whatever was written while the snapshot was read. (Compaction may drop an
older value of a key the snapshot phase has not reached yet; the snapshot then holds a later
value instead, which is still the key's value at the ends or a newer one the change phase
repeats: folding it again is idempotent for last-value state.)

``live_only`` skips the snapshot: the ends are the starting point (a tail of new records),
or the offsets in ``resume`` (a tail that restarts where it stopped).
A topic that does not exist is reported in :attr:`missing` and followed by nobody.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Final

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.assigned import fetch_until, start_assigned
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.records import InboxRecord, inbox_record_of
from pipeline.adapters.kafka.topic_scan import scan_fetch_options
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

_BATCH: Final = 5000
# A fetch returns after this long even with little data: the snapshot's last rounds (a few
# records short of the ends) and live changes wait for it, not the client's 500 ms.
_FETCH_WAIT_MS: Final = 100


class CompactedFollow:
    """Every record of ``topics`` (of the partition of ``only_key`` in each): up to the ends
    taken at start, then live."""

    def __init__(self, settings: Settings, topics: Sequence[str], *,
                 live_only: bool = False, poll_ms: int = 200,
                 resume: Mapping[tuple[str, int], int] | None = None,
                 only_key: bytes | None = None) -> None:
        self.topics = tuple(topics)
        self.only_key = only_key   # read only the partition of this key (None: all)
        self.live_only = live_only
        self.resume = dict(resume or {})  # live_only: (topic, partition) -> where to go on
        self.poll_ms = poll_ms
        self.ends: dict[TopicPartition, int] = {}
        self.missing: list[str] = []
        self.snapshot_records = 0
        self._settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._stash: list[InboxRecord] = []

    async def __aenter__(self) -> CompactedFollow:
        await self.start()  # a failed or cancelled start leaves no client open
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        started = await start_assigned(
            self._settings, self.topics, what=f"follow {', '.join(self.topics)}",
            start_at="end" if self.live_only else "beginning",
            resume=self.resume if self.live_only else None, only_key=self.only_key,
            fetch_max_wait_ms=_FETCH_WAIT_MS, **scan_fetch_options(self._settings))
        self._consumer = started.consumer
        self.missing, self.ends = started.missing, started.ends

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    def _client(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise BrokerError("CompactedFollow used before start()")
        return self._consumer

    async def snapshot(self) -> AsyncIterator[list[InboxRecord]]:
        """Batches of the records below the ends, each partition in offset order."""
        if self.live_only:
            return
        ends = {tp: end for tp, end in self.ends.items() if end > 0}
        async for fetched in fetch_until(self._client(), ends, max_records=_BATCH,
                                         what=f"read {', '.join(self.topics)}"):
            batch: list[InboxRecord] = []
            for tp, raws in fetched.items():
                end = self.ends[tp]
                for raw in raws:
                    (batch if raw.offset < end else self._stash).append(inbox_record_of(raw))
            self.snapshot_records += len(batch)
            if batch:
                yield batch

    async def changes(self) -> AsyncIterator[list[InboxRecord]]:
        """Batches of the records at or past the ends, as they arrive (never ends)."""
        consumer = self._client()
        if self._stash:
            stash, self._stash = self._stash, []
            yield stash
        if not self.ends:
            return
        while True:
            with broker_errors(f"follow {', '.join(self.topics)}"):
                fetched = await consumer.getmany(timeout_ms=self.poll_ms, max_records=_BATCH)
            batch = [inbox_record_of(raw) for raws in fetched.values() for raw in raws]
            if batch:
                yield batch


