"""The processors' dead letters, written at most once per record: fenced per partition.

The processors fold without transactions, so two workers can fold the same partition of the
session topic for a while: the one that lost it (a session expired during a network fault,
a produce retried after a broker fault) and its new owner. Each dead-lettered the same
record, and the check before a dead letter (which offsets the dead-letter partition already
holds, :mod:`.dlq_reader`) could not see a letter the other one was still writing
(``dsh.session-events[5]`` offset 4962 twice, chaos seed 22142).

Rule: dead letters of source partition p are written in transactions of one transactional
id per p (``<app id>-dlq-p<p>``). A worker **claims** p before its first dead letter since
its assignment: starting that producer fences every earlier writer of p's dead letters
(their open transaction is aborted, their next one refused), and only then does it read
which records p's dead-letter partition holds (read committed). A letter is written by a
claimant only, after that read, so each record is dead-lettered at most once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.transactional import FencedError, PartitionProducer
from pipeline.core.errors import BrokerError
from pipeline.settings import Settings

log = logging.getLogger(__name__)


def dlq_transactional_id(app_id: str, partition: int) -> str:
    """The transactional id of the dead letters of source partition ``partition``."""
    return f"{app_id}-dlq-p{partition}"


class DeadLetterWriter:
    """One transactional producer per claimed source partition."""

    def __init__(self, settings: Settings, app_id: str) -> None:
        self._settings = settings
        self._app_id = app_id
        self._producers: dict[int, PartitionProducer] = {}

    async def claim(self, partition: int) -> None:
        """Fence every earlier writer of ``partition``'s dead letters (a new producer, even
        if this worker had one: another may have claimed the partition since). The new one
        starts first: this worker's old one is fenced by it, then closed."""
        producer = PartitionProducer(self._settings, group_id=self._app_id,
                                     partition=partition, owner="processors worker claimed "
                                     "the dead letters of partition",
                                     transactional_id=dlq_transactional_id(self._app_id,
                                                                           partition))
        await producer.start()
        await self._release(partition)
        self._producers[partition] = producer

    async def write(self, partition: int, letters: Sequence[OutRecord]) -> None:
        """Write ``letters`` in one transaction; raises :class:`BrokerError` (and forgets
        the claim when fenced: the next claim starts over)."""
        producer = self._producers.get(partition)
        if producer is None:
            raise BrokerError(f"dead letters of partition {partition} written unclaimed")
        try:
            await producer.commit(letters)
        except FencedError:
            await self._release(partition)
            raise

    async def release(self) -> None:
        """Stop every producer (partitions moved, or the worker stops)."""
        for partition in list(self._producers):
            await self._release(partition)

    async def _release(self, partition: int) -> None:
        producer = self._producers.pop(partition, None)
        if producer is not None:
            await producer.close()
