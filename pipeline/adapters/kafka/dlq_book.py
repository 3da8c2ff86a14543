"""A record of the session topic is dead-lettered at most once, across kills and rebalances.

The processors' executor (:mod:`pipeline.adapters.faust.executor`) writes a plan's dead
letters through one :class:`DeadLetterBook`, the dead letters of a partition to the
partition of the dead-letter topic with the same number. A kill -9 (or a rebalance) before
the commit past the record makes the next owner read it again, and a worker that lost the
partition may still be folding it. So before its first dead letter of a partition since the
assignment, the worker **claims** the partition's dead letters (a :class:`DeadLetterSink`: a
transactional producer per partition, which fences every earlier writer of them,
:mod:`pipeline.adapters.kafka.dlq_writer`), then asks the dead-letter topic which offsets of
that partition it holds from the first offset the worker was given (the committed one:
:data:`DeadLettered`), and does not dead-letter those again. A claim or read that fails
fails the batch, which is folded again (nothing is dead-lettered unchecked).

Without a sink (unit tests) letters go out with the folds' outputs, and a failed read
writes the letter anyway (a repeat rather than a loss).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from pipeline.adapters.kafka.dlq import MAX_RECORD_BYTES, dead_letter
from pipeline.adapters.kafka.records import InboxRecord, OutRecord, headers_of
from pipeline.codec.records import ConsumedRecord
from pipeline.core.errors import DshError, SequenceError

log = logging.getLogger(__name__)

# (partition, first offset folded since the assignment) -> the offsets at or above it that
# the dead-letter topic holds (:func:`pipeline.adapters.kafka.dlq_reader.
# dead_lettered_offsets` in the worker).
DeadLettered = Callable[[int, int], Awaitable[set[int]]]
Send = Callable[[OutRecord], Awaitable[object]]


class LetterCounts(Protocol):
    dead_letters: int
    dead_letters_skipped: int


class DeadLetterSink(Protocol):
    """Where the dead letters of claimed partitions are written, each batch's in one go."""

    async def claim(self, partition: int) -> None: ...
    async def write(self, partition: int, letters: Sequence[OutRecord]) -> None: ...
    async def release(self) -> None: ...


class DeadLetterBook:
    """Per partition: the first offset folded since the assignment, and the offsets
    dead-lettered from it on (read from the dead-letter topic once, then kept here)."""

    def __init__(self, dead_lettered: DeadLettered | None = None,
                 sink: DeadLetterSink | None = None, *,
                 counters: LetterCounts, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.dead_lettered = dead_lettered
        self.sink = sink
        self.counters = counters
        self.max_record_bytes = max_record_bytes
        self.letters: list[tuple[int, OutRecord]] = []   # this batch's, for the sink
        self.first_offsets: dict[int, int] = {}
        self.dead: dict[int, set[int]] = {}

    def folding(self, partition: int, offset: int) -> None:
        """A batch of ``partition`` starting at ``offset`` is about to be folded."""
        self.first_offsets.setdefault(partition, offset)

    def forget(self) -> None:
        """Partitions moved: the next batches start again from the committed offsets, and a
        partition's next dead letter claims it again (another owner may have had it)."""
        self.first_offsets.clear()
        self.dead.clear()
        self.letters = []

    async def letter(self, record: ConsumedRecord, error: Exception, send: Send) -> None:
        """Dead-letter ``record`` for ``error``, unless it was before: with a sink at the
        batch's end (:meth:`write_batch`), else at once through ``send`` (the batch's
        output sender)."""
        if await self.already(record.partition, record.offset):
            self.counters.dead_letters_skipped += 1
            return
        if not isinstance(error, SequenceError):
            log.warning("dead letter from %s[%d]@%d: %s: %s", record.topic, record.partition,
                        record.offset, type(error).__name__, error)
        letter = replace(dead_letter(_inbox_record(record), error, self.max_record_bytes),
                         partition=record.partition)
        if self.sink is not None:
            self.letters.append((record.offset, letter))
            return
        self.counters.dead_letters += 1
        await send(letter)
        await self.add(record.partition, record.offset)

    async def write_batch(self, partition: int) -> None:
        """The batch's dead letters, in one transaction of the partition's claimant."""
        if not self.letters or self.sink is None:
            return
        await self.sink.write(partition, [letter for _, letter in self.letters])
        for offset, _ in self.letters:
            await self.add(partition, offset)
        self.counters.dead_letters += len(self.letters)
        self.letters = []

    def drop_batch(self) -> None:
        """The batch failed: its letters were not written (it is folded again)."""
        self.letters = []

    async def already(self, partition: int, offset: int) -> bool:
        """Whether the record at ``offset`` was dead-lettered before."""
        return offset in await self._dead(partition)

    async def add(self, partition: int, offset: int) -> None:
        (await self._dead(partition)).add(offset)

    async def _dead(self, partition: int) -> set[int]:
        dead = self.dead.get(partition)
        if dead is None:
            dead = set()
            since = self.first_offsets.get(partition)
            if self.sink is not None:
                await self.sink.claim(partition)   # fences earlier writers, then the read
            if self.dead_lettered is not None and since is not None:
                try:
                    dead = await self.dead_lettered(partition, since)
                except DshError as exc:
                    if self.sink is not None:
                        raise
                    log.warning("reading the dead letters of partition %d failed (%s): a "
                                "record dead-lettered before may be dead-lettered again",
                                partition, exc)
            self.dead[partition] = dead
        return dead


def _inbox_record(record: ConsumedRecord) -> InboxRecord:
    if isinstance(record, InboxRecord):
        return record
    return InboxRecord(record.topic, record.partition, record.offset, record.key,
                       record.value, headers_of(record.headers))
