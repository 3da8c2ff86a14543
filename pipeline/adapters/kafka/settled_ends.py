"""End offsets that no open transaction holds back, for reads that must see every commit.

A read committed consumer ends at a partition's last stable offset (LSO): the first offset of
the oldest transaction still open there, else the high watermark. The records of a
transaction open below the high watermark may be committed a moment later. A reader that
takes the LSO for "everything written" and acts on it, such as the shipper and ``import``
reading each session's next seq (:func:`.topic_scan.last_seqs`), would then miss those
events and write them again. :func:`settled_ends` waits until every transaction open when
it was called has ended: the LSO reaches the high watermark seen then. Transactions begun
later start above that watermark, so they do not hold it back.

A transaction ends within its producer's transaction timeout (ours: 60 s, after which the
coordinator aborts it). One that never ends is a *hanging transaction*. It has been seen after
an unclean restart of a one-node broker right after a commit: the coordinator skipped the
commit markers ("Couldn't find leader endpoint ... likely deleted already" in its log), so
every read committed reader of the partition stops at that transaction until an operator
aborts it. After ``budget_s`` the wait raises :class:`BrokerError` naming the partition, the
offsets and the command that aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Final

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.adapters.kafka.errors import broker_errors
from pipeline.adapters.kafka.options import client_options
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

log = logging.getLogger(__name__)

# Our producers' transaction timeout (60 s), the coordinator's sweep for timed-out ones (10 s),
# and slack: a transaction still open after this is not one a live producer will end.
SETTLE_BUDGET_S: Final = 90.0
WARN_AFTER_S: Final = 5.0
_FIRST_POLL_S: Final = 0.05
_LAST_POLL_S: Final = 1.0


async def high_watermarks(settings: Settings, parts: Sequence[TopicPartition], *,
                          what: str) -> dict[TopicPartition, int]:
    """Each partition's high watermark (read uncommitted end offsets)."""
    consumer = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_uncommitted",
                                **client_options(settings))
    try:
        with broker_errors(what):
            await consumer.start()
            # Assigned first, so the client fetches their metadata at once: asked cold, the
            # lookup took 112 ms (median of 15) against 16 ms (docs/decisions/settled-reads.md).
            consumer.assign(list(parts))
            ends: dict[TopicPartition, int] = await consumer.end_offsets(list(parts))
            return ends
    finally:
        await consumer.stop()


async def settled_ends(settings: Settings, consumer: AIOKafkaConsumer,
                       stable: Mapping[TopicPartition, int], *, what: str,
                       budget_s: float = SETTLE_BUDGET_S) -> dict[TopicPartition, int]:
    """``stable`` (the read committed ``consumer``'s end offsets of its partitions) once
    every transaction open below the high watermarks has ended: the offsets to read up to.
    Raises :class:`BrokerError` when one is still open after ``budget_s``."""
    ends = dict(stable)
    marks = await high_watermarks(settings, list(ends), what=what)
    held = sorted(tp for tp, end in ends.items() if end < marks[tp])
    started = time.monotonic()
    delay, warned = _FIRST_POLL_S, False
    while held:
        waited = time.monotonic() - started
        if waited > budget_s:
            raise BrokerError(_hanging(what, held[0], ends[held[0]], marks[held[0]], waited))
        if not warned and waited > WARN_AFTER_S:
            warned = True
            log.warning("%s: waiting for %d partition(s) with a transaction still open "
                        "(first: %s[%d] from offset %d, high watermark %d)", what, len(held),
                        held[0].topic, held[0].partition, ends[held[0]], marks[held[0]])
        await asyncio.sleep(delay)
        delay = min(delay * 2, _LAST_POLL_S)
        with broker_errors(what):
            ends.update(await consumer.end_offsets(held))
        held = [tp for tp in held if ends[tp] < marks[tp]]
    return ends


def _hanging(what: str, tp: TopicPartition, stable: int, mark: int, waited: float) -> str:
    return (f"{what}: partition {tp.topic}[{tp.partition}] still has a transaction open from "
            f"offset {stable} (high watermark {mark}) after {waited:.0f} s. Its records may be "
            "committed, so reading to the last stable offset could miss them. A transaction "
            "that never ends (a hanging transaction, as after an unclean restart of a one-node "
            "broker) is aborted with: kafka-transactions.sh --bootstrap-server BROKER abort "
            f"--topic {tp.topic} --partition {tp.partition} --start-offset {stable}")
