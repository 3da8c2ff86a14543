"""The driver's consumer-group member on the inbox topic.

Offsets are never committed by this consumer: the driver commits them inside its
transactions (``send_offsets_to_transaction``), so ``enable_auto_commit`` is off. The
consumer reads ``read_committed`` so inbox records written transactionally by other tools
are seen only once committed.

aiokafka rebalances eagerly: every rebalance revokes all partitions, then assigns (possibly
the same ones again). The listener's callbacks are awaited inside the rebalance; slow work
there delays the whole group, so the driver keeps them short.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from pipeline.adapters.kafka.errors import broker_errors, quietly
from pipeline.adapters.kafka.options import client_options, consumer_size_options
from pipeline.adapters.kafka.records import InboxRecord, headers_of
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

log = logging.getLogger(__name__)

PartitionsCallback = Callable[[list[int]], Awaitable[None]]


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, on_assigned: PartitionsCallback, on_revoked: PartitionsCallback) -> None:
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._on_revoked(sorted(tp.partition for tp in revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        await self._on_assigned(sorted(tp.partition for tp in assigned))


class InboxConsumer:
    """A member of ``group_id`` consuming ``topic``; callbacks get partition numbers."""

    def __init__(self, settings: Settings, *, topic: str, group_id: str,
                 on_assigned: PartitionsCallback, on_revoked: PartitionsCallback,
                 max_poll_interval_ms: int = 300_000, session_timeout_ms: int = 10_000,
                 group_instance_id: str | None = None) -> None:
        self.topic = topic
        self.group_id = group_id
        self._listener = _Listener(on_assigned, on_revoked)
        self._options = client_options(settings)
        self._consumer = AIOKafkaConsumer(
            **self._options, **consumer_size_options(settings), group_id=group_id,
            enable_auto_commit=False,
            isolation_level="read_committed", auto_offset_reset="earliest",
            max_poll_interval_ms=max_poll_interval_ms, session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=max(session_timeout_ms // 4, 500),
            group_instance_id=group_instance_id,
        )

    async def start(self) -> None:
        try:
            with broker_errors(f"cannot join group {self.group_id!r} on {self.topic}"):
                await self._consumer.start()
                self._consumer.subscribe([self.topic], listener=self._listener)
        except BrokerError:
            await self._consumer.stop()
            raise

    async def poll(self, timeout_ms: int = 200, max_records: int = 500) -> list[InboxRecord]:
        """Records from every assigned, unpaused partition (per partition in offset order)."""
        with broker_errors(f"consuming {self.topic} in group {self.group_id!r} failed"):
            fetched = await self._consumer.getmany(timeout_ms=timeout_ms,
                                                   max_records=max_records)
        out: list[InboxRecord] = []
        for tp, records in fetched.items():
            out.extend(
                InboxRecord(topic=tp.topic, partition=tp.partition, offset=r.offset,
                            key=r.key, value=r.value, headers=headers_of(r.headers),
                            timestamp_ms=r.timestamp or 0)
                for r in records)
        return out

    def assigned(self) -> set[int]:
        return {tp.partition for tp in self._consumer.assignment()}

    def pause(self, partitions: set[int] | None = None) -> None:
        """Stop fetching ``partitions`` (all assigned ones when None)."""
        self._consumer.pause(*self._tps(partitions))

    def resume(self, partitions: set[int] | None = None) -> None:
        self._consumer.resume(*self._tps(partitions))

    def paused(self) -> set[int]:
        return {tp.partition for tp in self._consumer.paused()}

    def seek(self, partition: int, offset: int) -> bool:
        """Fetch ``partition`` from ``offset`` on; False (and nothing done) when it is not in
        the current assignment.

        The seek holds for the current assignment only: a rebalance replaces it, and the new
        one fetches from the group's committed offset. Records already fetched from before
        the seek are not returned.
        """
        tp = TopicPartition(self.topic, partition)
        if tp not in self._consumer.assignment():
            return False
        self._consumer.seek(tp, offset)
        return True

    def rejoin(self) -> None:
        """Join the group again: a rebalance, or (a follower whose subscription is unchanged
        in a stable group) the current assignment confirmed; either way the listener's
        callbacks run as after a rebalance, and fetching waits for the assignment."""
        self._consumer.subscribe([self.topic], listener=self._listener)

    async def committed(self, partition: int) -> tuple[int | None, str]:
        """The group's committed offset of ``partition`` (None if none) and its metadata.

        Raises :class:`BrokerError` when the group coordinator cannot answer (see
        :func:`read_committed`): the caller tries again, it never starts over.
        """
        return await read_committed(self._options, self.group_id,
                                    TopicPartition(self.topic, partition))

    def _tps(self, partitions: set[int] | None) -> list[Any]:
        assigned = self._consumer.assignment()
        if partitions is None:
            return list(assigned)
        return [tp for tp in assigned if tp.partition in partitions]

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Leave the group (no offsets are committed here). Never raises."""
        with quietly(f"leaving group {self.group_id!r}", log):
            await asyncio.wait_for(self._consumer.stop(), timeout_s)


async def read_committed(options: dict[str, Any], group_id: str, tp: Any, *,
                         coordinator_id: int | None = None) -> tuple[int | None, str]:
    """``group_id``'s committed offset of ``tp`` (None if it has none) and its metadata.

    The group coordinator answers every partition asked for, with offset -1 when the group
    has none. An answer without the partition carries a group-level error instead (the
    coordinator moved, is still loading the group's offsets, or refuses the principal;
    aiokafka's admin client drops that error): it raises :class:`BrokerError`, because
    reading it as "no committed offset" would make a new owner start over from the earliest
    offset without the commit's metadata (dead letters and cancels already applied).
    ``coordinator_id`` asks that node instead of looking the coordinator up.
    """
    where = f"the committed offset of {tp.topic}[{tp.partition}] for group {group_id!r}"
    admin = AIOKafkaAdminClient(**options)
    try:
        with broker_errors(f"reading {where} failed"):
            await admin.start()
            found = await admin.list_consumer_group_offsets(
                group_id, group_coordinator_id=coordinator_id, partitions=[tp])
    finally:
        await admin.close()
    entry = found.get(tp)
    if entry is None:
        raise BrokerError(f"reading {where} failed: the group coordinator answered with a "
                          "group-level error (coordinator moving, loading its offsets, or "
                          "not authorized); try again")
    if entry.offset < 0:
        return None, ""
    return int(entry.offset), entry.metadata or ""
