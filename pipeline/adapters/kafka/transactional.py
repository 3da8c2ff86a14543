"""A transactional producer owned by one inbox partition.

Fencing without KIP-447 (aiokafka speaks only the old offsets-in-transaction protocol): the
transactional id is derived from the *input* partition, ``<group>-driver-p<partition>``, so the
driver that is assigned inbox partition p fences every earlier owner of p when it starts its
producer (InitProducerId bumps the epoch and aborts the old owner's open transaction).

One :meth:`PartitionProducer.commit` is one Kafka transaction: the records and, optionally,
the consumer-group offset of the inbox partition are committed atomically, or nothing is.
Every aiokafka failure reaches the caller as :class:`BrokerError`; ``fenced`` tells the
caller that another owner exists and the partition must be given up (not retried).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from pipeline.adapters.faust import private_api
from pipeline.adapters.kafka.errors import broker_errors, is_fencing, quietly
from pipeline.adapters.kafka.options import client_options, producer_size_options
from pipeline.adapters.kafka.records import OutRecord
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

log = logging.getLogger(__name__)

# One transaction carries hundreds of records per partition, and an idempotent producer has
# one produce request in flight per partition: big batches mean few round trips per commit.
MAX_BATCH_BYTES = 512 * 1024


def transactional_id_for(group_id: str, partition: int) -> str:
    """The transactional id of the driver that owns inbox partition ``partition``."""
    return f"{group_id}-driver-p{partition}"


class FencedError(BrokerError):
    """Another producer with the same transactional id exists: this owner must give up."""


class PartitionProducer:
    """The transactional producer of one owned inbox partition."""

    def __init__(self, settings: Settings, *, group_id: str, partition: int,
                 transaction_timeout_ms: int = 60_000, request_timeout_s: float = 30.0,
                 transactional_id: str | None = None,
                 owner: str = "driver owns inbox partition") -> None:
        self.group_id = group_id
        self.partition = partition
        self.transactional_id = transactional_id or transactional_id_for(group_id, partition)
        self.owner = owner   # what another owner is when this one is fenced
        self._settings = settings
        self._transaction_timeout_ms = transaction_timeout_ms
        self._request_timeout_s = request_timeout_s
        self._producer: Any = None
        self.fenced = False
        self.transactions_committed = 0

    async def start(self) -> None:
        """Start and fence older owners: waits until this producer holds the newest epoch."""
        producer = AIOKafkaProducer(
            **client_options(self._settings), **producer_size_options(self._settings),
            transactional_id=self.transactional_id,
            transaction_timeout_ms=self._transaction_timeout_ms,
            enable_idempotence=True, acks="all", linger_ms=0, retry_backoff_ms=20,
            max_batch_size=MAX_BATCH_BYTES,
        )
        try:
            await self._guarded(producer.start(), "start")
            self._producer = producer
            # An empty transaction waits for InitProducerId, which is the fencing step.
            await self._guarded(self._empty_transaction(), "initialise transactions")
        except BaseException:
            await self._stop_quietly(producer)
            self._producer = None
            raise

    async def _empty_transaction(self) -> None:
        await self._producer.begin_transaction()
        await self._producer.commit_transaction()

    async def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` has (BrokerError when it does not exist)."""
        if self._producer is None:
            raise BrokerError(f"producer {self.transactional_id} is not started")
        partitions = await self._producer.partitions_for(topic)
        if not partitions:
            raise BrokerError(f"topic {topic!r} does not exist: run `dsh-pipeline topics "
                              "ensure`")
        return len(partitions)

    async def commit(self, records: Sequence[OutRecord],
                     inbox_offsets: Mapping[tuple[str, int], tuple[int, str]] | None = None
                     ) -> list[int]:
        """One transaction: ``records`` plus the group's next inbox offsets, atomically.

        ``inbox_offsets`` maps (topic, partition) to (offset of the next record to consume,
        commit metadata). Returns the offset each record was written at, in ``records``'
        order. On failure the transaction is aborted (if still possible) and
        :class:`BrokerError` (:class:`FencedError` when fenced) is raised.
        """
        if self._producer is None:
            raise BrokerError(f"producer {self.transactional_id} is not started")
        written: list[int] = []
        await self._guarded(self._transaction(records, inbox_offsets, written),
                            "commit a transaction")
        self.transactions_committed += 1
        return written

    async def _transaction(self, records: Sequence[OutRecord],
                           inbox_offsets: Mapping[tuple[str, int], tuple[int, str]] | None,
                           written: list[int]) -> None:
        producer = self._producer
        await producer.begin_transaction()
        try:
            sent = await _send_all(producer, records)
            if sent:
                metadata = await asyncio.gather(*(future for future, _ in sent))
                written.extend(_record_offsets(sent, metadata, len(records)))
            if inbox_offsets:
                offsets = {TopicPartition(t, p): o for (t, p), o in inbox_offsets.items()}
                await producer.send_offsets_to_transaction(offsets, self.group_id)
        except BaseException:
            await self._abort_quietly()
            raise
        await producer.commit_transaction()

    async def _abort_quietly(self) -> None:
        with quietly(f"abort of {self.transactional_id}", log):
            if not private_api.transaction_failed_fatally(self._producer):
                await asyncio.wait_for(self._producer.abort_transaction(),
                                       self._request_timeout_s)

    async def _guarded(self, work: Any, what: str) -> None:
        """Run ``work`` with a timeout, translating aiokafka errors into BrokerError."""
        try:
            with broker_errors(f"producer {self.transactional_id} failed to {what}",
                               timeout_s=self._request_timeout_s):
                await asyncio.wait_for(work, self._request_timeout_s)
        except BrokerError as exc:
            if not is_fencing(exc):
                raise
            self.fenced = True
            raise FencedError(
                f"producer {self.transactional_id} was fenced while trying to {what}: another "
                f"{self.owner} {self.partition} now "
                f"({type(exc.__cause__).__name__})") from exc.__cause__

    async def close(self) -> None:
        """Abort any open transaction and stop. Never raises."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        await self._stop_quietly(producer)

    async def _stop_quietly(self, producer: Any) -> None:
        with quietly(f"stop of {self.transactional_id}", log):
            await asyncio.wait_for(producer.stop(), self._request_timeout_s)


async def _send_all(producer: Any, records: Sequence[OutRecord]
                    ) -> list[tuple[Any, list[int]]]:
    """Queue ``records`` in order; one delivery future per batch or per record, each with
    the indices (into ``records``) of the records it delivers, in their order in it.

    Records with a partition go into one batch per (topic, partition), built here and
    handed over whole: a transaction of a step's events (hundreds of chunks) would
    otherwise pay aiokafka's per-``send`` bookkeeping for each record and hold the event
    loop while it does. Records without a partition (the default partitioner) are sent one
    by one. Order within a partition is kept: a partition's records are either all in
    batches or all sent singly, since the driver names the partition of every event.
    """
    sent: list[tuple[Any, list[int]]] = []
    builders: dict[tuple[str, int], tuple[Any, list[int]]] = {}
    for index, record in enumerate(records):
        if record.partition is None:
            sent.append((await producer.send(record.topic, record.value, key=record.key,
                                             headers=list(record.headers) or None), [index]))
            continue
        where = (record.topic, record.partition)
        open_batch = builders.get(where)
        if open_batch is None or not _append(open_batch[0], record):
            if open_batch is not None:  # full: hand it over, start the next one
                sent.append((await producer.send_batch(open_batch[0], where[0],
                                                       partition=where[1]), open_batch[1]))
            open_batch = builders[where] = (producer.create_batch(), [])
            _append(open_batch[0], record)  # an empty batch takes any one record
        open_batch[1].append(index)
    for (topic, partition), (builder, indices) in builders.items():
        sent.append((await producer.send_batch(builder, topic, partition=partition), indices))
    return sent


def _record_offsets(sent: Sequence[tuple[Any, list[int]]], metadata: Sequence[Any],
                    count: int) -> list[int]:
    """The offset of each record: a batch's records follow its base offset in order."""
    offsets = [-1] * count
    for (_, indices), delivered in zip(sent, metadata, strict=True):
        for position, index in enumerate(indices):
            offsets[index] = delivered.offset + position
    return offsets


def _append(builder: Any, record: OutRecord) -> bool:
    """Add ``record`` to ``builder``; False when the batch is full."""
    return builder.append(timestamp=None, key=record.key, value=record.value,
                          headers=list(record.headers)) is not None
