"""A consumer assigned to every partition of some topics (no group, read committed): the start
shared by the readers that read up to offsets taken when they start (``TopicScan``,
``CompactedFollow``), and their read up to those offsets (:func:`fetch_until`).

The offsets are listed *before* the partitions are assigned. Once a partition is assigned
and positioned, the client keeps a fetch parked at the broker for up to its fetch wait, and
a broker answers one connection's requests in order: every offset lookup made after the
assignment would wait behind that fetch (500 ms each with the client's default wait).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import murmur2
from aiokafka.protocol.metadata import MetadataRequest

from pipeline.adapters.faust import private_api
from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.adapters.kafka.settled_ends import settled_ends
from pipeline.settings import Settings

StartAt = Literal["beginning", "end"]


@dataclass(slots=True)
class AssignedTopics:
    """A started consumer, assigned and positioned, with the offsets it started from."""

    consumer: AIOKafkaConsumer
    starts: dict[TopicPartition, int] = field(default_factory=dict)  # first offsets
    ends: dict[TopicPartition, int] = field(default_factory=dict)    # last stable offsets
    missing: list[str] = field(default_factory=list)  # topics that do not exist


async def start_assigned(settings: Settings, topics: Sequence[str], *, what: str,
                         start_at: StartAt = "beginning",
                         resume: Mapping[tuple[str, int], int] | None = None,
                         only_key: bytes | None = None,
                         settle_s: float | None = None,
                         **options: Any) -> AssignedTopics:
    """A consumer on every partition of ``topics`` (or, with ``only_key``, on the one the
    default partitioner gives that key in each topic), positioned at each partition's first
    offset (``start_at="beginning"``) or end, or where ``resume`` says ((topic, partition)
    -> offset). ``options`` go to the client (fetch sizes and waits). Nothing is left open
    when it fails or is cancelled. ``what`` names the read in errors. ``settle_s``: the end
    offsets are taken once the transactions open below the high watermarks have ended
    (:func:`.settled_ends.settled_ends`, waiting at most that long); None: as they are."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_committed",
                                auto_offset_reset="earliest", **client_options(settings),
                                **options)
    try:
        with broker_errors(what):
            await consumer.start()
            found = await _listed(consumer, topics, only_key)
        if settle_s is not None and found.ends:
            found.ends = await settled_ends(settings, consumer, found.ends, what=what,
                                            budget_s=settle_s)
        _position(found, start_at, resume or {})
        return found
    except BaseException:
        await consumer.stop()
        raise


async def _listed(consumer: AIOKafkaConsumer, topics: Sequence[str], only_key: bytes | None
                  ) -> AssignedTopics:
    """The partitions to read and their first and last stable offsets (not yet assigned)."""
    found = AssignedTopics(consumer)
    known = await topic_partitions(consumer, topics)
    parts: list[TopicPartition] = []
    for topic in topics:
        ids = known.get(topic)
        if not ids:
            found.missing.append(topic)
        if ids and only_key is not None:
            ids = [key_partition(only_key, len(ids))]
        parts += [TopicPartition(topic, p) for p in ids or ()]
    if not parts:
        return found
    found.starts = await consumer.beginning_offsets(parts)
    found.ends = await consumer.end_offsets(parts)
    return found


def _position(found: AssignedTopics, start_at: StartAt,
              resume: Mapping[tuple[str, int], int]) -> None:
    """Assign the partitions and seek each (after every offset lookup: see the module doc)."""
    if not found.starts:
        return
    consumer = found.consumer
    consumer.assign(list(found.starts))
    for tp in found.starts:
        default = found.starts[tp] if start_at == "beginning" else found.ends[tp]
        consumer.seek(tp, resume.get((tp.topic, tp.partition), default))


async def fetch_until(consumer: AIOKafkaConsumer, ends: Mapping[TopicPartition, int], *,
                      what: str, max_records: int) -> AsyncIterator[dict[TopicPartition, Any]]:
    """What each fetch returns, fetch after fetch, until every partition's position reaches
    its end in ``ends``. A fetch may hold records at or past an end: the caller cuts them.
    ``what`` names the read in errors."""
    remaining = dict(ends)
    while remaining:
        with broker_errors(what):
            for tp in list(remaining):  # markers can put the position past the last record
                if await consumer.position(tp) >= remaining[tp]:
                    del remaining[tp]
            if not remaining:
                return
            fetched = await consumer.getmany(*remaining, timeout_ms=500,
                                             max_records=max_records)
        yield fetched


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` (murmur2, positive)."""
    return (int(murmur2(key)) & 0x7FFFFFFF) % partitions


async def topic_partitions(consumer: AIOKafkaConsumer, topics: Sequence[str]
                           ) -> dict[str, list[int]]:
    """The partition ids of each of ``topics`` that exists (:func:`topic_leaders`)."""
    return {topic: sorted(leaders) for topic, leaders in
            (await topic_leaders(consumer, topics)).items()}


async def topic_leaders(consumer: AIOKafkaConsumer, topics: Sequence[str]
                        ) -> dict[str, dict[int, int]]:
    """Each partition's leader (-1: none yet) of each of ``topics`` that exists, from fresh
    metadata of those topics alone: a metadata request for every topic costs its size (~0.4 s
    of parsing for 3,000 topics), and one naming a missing topic must not create it
    (broker-side auto-creation), which is why the request says so. Raises the client's
    errors."""
    client = private_api.client_of(consumer)
    request = MetadataRequest(list(topics), allow_auto_topic_creation=False)
    response = await client.send(client.get_random_node(), request)
    found: dict[str, dict[int, int]] = {}
    for topic_data in response.topics:
        error_code, topic, _internal, partitions = tuple(topic_data)[:4]
        if error_code == 0 and partitions:
            found[topic] = {int(part[1]): int(part[2]) if part[0] == 0 else -1
                            for part in partitions}
    return found
