"""A record of the session topic is dead-lettered once, across kills and rebalances.

The processors send a dead letter at once, outside any transaction, to the partition of the
dead-letter topic with the record's partition number. A kill -9 (or a rebalance) before the
commit past the record makes the next owner read it again. So before its first dead letter
of a partition since the assignment, the worker asks the dead-letter topic which offsets of
that partition it holds from the first offset the worker was given (the committed one:
:data:`DeadLettered`), and does not dead-letter those again. Should that read fail, the
dead letter is written (a repeat rather than a loss).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from pipeline.core.errors import DshError

log = logging.getLogger(__name__)

# (partition, first offset folded since the assignment) -> the offsets at or above it that
# the dead-letter topic holds (:func:`pipeline.adapters.kafka.dlq_reader.
# dead_lettered_offsets` in the worker).
DeadLettered = Callable[[int, int], Awaitable[set[int]]]


class DeadLetterBook:
    """Per partition: the first offset folded since the assignment, and the offsets
    dead-lettered from it on (read from the dead-letter topic once, then kept here)."""

    def __init__(self, dead_lettered: DeadLettered | None = None) -> None:
        self.dead_lettered = dead_lettered
        self.first_offsets: dict[int, int] = {}
        self.dead: dict[int, set[int]] = {}

    def folding(self, partition: int, offset: int) -> None:
        """A batch of ``partition`` starting at ``offset`` is about to be folded."""
        self.first_offsets.setdefault(partition, offset)

    def forget(self) -> None:
        """Partitions moved: the next batches start again from the committed offsets."""
        self.first_offsets.clear()
        self.dead.clear()

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
            if self.dead_lettered is not None and since is not None:
                try:
                    dead = await self.dead_lettered(partition, since)
                except DshError as exc:
                    log.warning("reading the dead letters of partition %d failed (%s): a "
                                "record dead-lettered before may be dead-lettered again",
                                partition, exc)
            self.dead[partition] = dead
        return dead
