"""Consumer lag per consumer group and partition, in records and in seconds.

Lag in seconds is what operators ask for: the age (``now`` minus the record timestamp) of the
first record a group has not consumed yet, 0 when the group is at the end. The probe lists the
cluster's consumer groups, their committed offsets on the topics asked for, the end offsets,
and for each lagging partition reads the timestamp of the record at the committed offset.

Lag is counted to the last stable offset (what a ``read_committed`` reader can reach), so a
transaction the broker leaves open shows no lag while every reader is stuck below it
(docs/troubleshooting.md, *A transaction stays open*). Each sample also reads the high
watermark of every partition (:attr:`ConsumerLagProbe.ends`), so that a last stable offset
that stands still below it can be alerted on (``DshTransactionHanging``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.adapters.kafka.assigned import topic_leaders
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options, consumer_size_options
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings


@dataclass(frozen=True, slots=True)
class LagSample:
    group: str
    topic: str
    partition: int
    committed: int
    end: int
    seconds: float

    @property
    def records(self) -> int:
        return max(0, self.end - self.committed)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "topic": self.topic, "partition": self.partition,
                "committed": self.committed, "end": self.end, "records": self.records,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True, slots=True)
class PartitionEnds:
    """A partition's last stable offset (the end a ``read_committed`` reader sees) and its
    high watermark: the records between them are in transactions not ended yet."""

    topic: str
    partition: int
    stable: int
    high: int

    @property
    def unstable(self) -> int:
        return max(0, self.high - self.stable)


class ConsumerLagProbe:
    """Reads the lag of every group on ``topics``; ``start``, ``sample`` often, ``stop``."""

    def __init__(self, settings: Settings, topics: Collection[str]) -> None:
        self._settings = settings
        self._topics = frozenset(topics)
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._uncommitted: AIOKafkaConsumer | None = None   # the high watermarks' reader
        self._led: set[TopicPartition] = set()   # partitions with a leader at the last sample
        # Both ends of every partition with a settled leader, as of the last sample: the
        # records between them are in transactions not ended (alert DshTransactionHanging).
        self.ends: list[PartitionEnds] = []

    async def start(self) -> None:
        options = client_options(self._settings)
        with broker_errors("start the consumer-lag probe"):
            self._admin = AIOKafkaAdminClient(**options)
            await self._admin.start()
            self._consumer = AIOKafkaConsumer(enable_auto_commit=False,
                                              isolation_level="read_committed", **options,
                                              **consumer_size_options(self._settings))
            await self._consumer.start()
            self._uncommitted = AIOKafkaConsumer(enable_auto_commit=False,
                                                 isolation_level="read_uncommitted", **options)
            await self._uncommitted.start()

    async def stop(self) -> None:
        admin, consumer, self._admin, self._consumer = self._admin, self._consumer, None, None
        uncommitted, self._uncommitted = self._uncommitted, None
        for reader in (consumer, uncommitted):
            if reader is not None:
                await reader.stop()
        if admin is not None:
            await admin.close()

    async def sample(self, now_ms: int, skip_groups: Collection[str] = ()) -> list[LagSample]:
        """The lag of every group; the same lookups set :attr:`ends`."""
        admin, consumer = self._admin, self._consumer
        if admin is None or consumer is None:
            return []
        with broker_errors("read consumer group offsets"):
            groups = sorted(str(g[0]) for g in await admin.list_consumer_groups())
            leaders = await topic_leaders(consumer, sorted(self._topics))
            tps = [TopicPartition(topic, p) for topic, parts in sorted(leaders.items())
                   for p in sorted(parts)]
            committed = await self._committed(admin, groups, skip_groups, tps)
            settled = self._settled(leaders)
            stable = await consumer.end_offsets(sorted({tp for _, tp in committed}
                                                       | set(settled)))
            self.ends = await self._ends(settled, stable)
        samples = []
        for (group, tp), offset in sorted(committed.items(), key=lambda kv: (kv[0][0],
                                          kv[0][1].topic, kv[0][1].partition)):
            end = stable.get(tp, offset)
            seconds = 0.0
            if offset < end:
                stamp = await self._timestamp_at(tp, offset)
                seconds = max(0.0, (now_ms - stamp) / 1000) if stamp is not None else 0.0
            samples.append(LagSample(group, tp.topic, tp.partition, offset, end, seconds))
        return samples

    @staticmethod
    async def _committed(admin: AIOKafkaAdminClient, groups: Sequence[str],
                         skip_groups: Collection[str], tps: Sequence[TopicPartition]
                         ) -> dict[tuple[str, TopicPartition], int]:
        """Each group's committed offset of each of ``tps`` (none: left out)."""
        committed: dict[tuple[str, TopicPartition], int] = {}
        for group in groups:
            if group in skip_groups or not tps:
                continue
            offsets = await admin.list_consumer_group_offsets(group, partitions=tps)
            _check_answered(group, offsets, tps)
            for tp, meta in offsets.items():
                if meta.offset >= 0:
                    committed[(group, tp)] = meta.offset
        return committed

    def _settled(self, leaders: Mapping[str, Mapping[int, int]]) -> list[TopicPartition]:
        """The partitions with a leader now and at the previous sample. A leader just
        elected (a topic just created, as in ``make demo``) can still answer
        NotLeaderForPartition, which aiokafka logs as an error while it retries: such a
        partition's ends are read from the next sample on."""
        led = {TopicPartition(topic, p) for topic, parts in leaders.items()
               for p, leader in parts.items() if leader >= 0}
        settled, self._led = sorted(led & self._led), led
        return settled

    async def _ends(self, tps: Sequence[TopicPartition],
                    stable: Mapping[TopicPartition, int]) -> list[PartitionEnds]:
        """Both ends of ``tps``, given their last stable offsets."""
        uncommitted = self._uncommitted
        if uncommitted is None or not tps:
            return []
        # assigned first: the client then fetches their metadata at once (settled reads)
        uncommitted.assign(list(tps))
        high = await uncommitted.end_offsets(list(tps))
        return [PartitionEnds(tp.topic, tp.partition, stable[tp], max(high[tp], stable[tp]))
                for tp in tps]

    async def _timestamp_at(self, tp: TopicPartition, offset: int) -> int | None:
        """The timestamp of the first record at or after ``offset`` (None: none readable)."""
        consumer = self._consumer
        assert consumer is not None
        with broker_errors(f"read {tp.topic}[{tp.partition}]@{offset}"):
            consumer.assign([tp])
            consumer.seek(tp, offset)
            batch = await consumer.getmany(tp, timeout_ms=500, max_records=1)
        records = batch.get(tp, [])
        return int(records[0].timestamp) if records else None


def _check_answered(group: str, offsets: Mapping[TopicPartition, Any],
                    asked: Collection[TopicPartition]) -> None:
    """The coordinator answers every partition asked for (offset -1: none committed); an
    answer without them carries a group-level error (the coordinator moving or loading the
    group's offsets), which aiokafka's admin client drops. A group left out of a sample would
    read as caught up: raise instead (the caller samples again)."""
    if any(tp not in offsets for tp in asked):
        raise BrokerError(f"the offsets of group {group!r}: the group coordinator answered "
                          "with a group-level error (coordinator moving or loading its "
                          "offsets); try again")


async def leaders_ready(settings: Settings, topic: str) -> bool:
    """True once ``topic`` exists and every partition has a leader (from metadata of that
    topic alone, :func:`~pipeline.adapters.kafka.assigned.topic_leaders`).

    A reader started right after the topic was created would otherwise log an error per
    retry (aiokafka's offset lookups fail with NotLeaderForPartition until the election).
    """
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **client_options(settings),
                                **consumer_size_options(settings))
    try:
        with broker_errors(f"read metadata of {topic!r}"):
            await consumer.start()
            leaders = (await topic_leaders(consumer, [topic])).get(topic, {})
        return bool(leaders) and all(leader >= 0 for leader in leaders.values())
    finally:
        await consumer.stop()
