"""The one executor of the processors' batch plans: what a batch and a commit do, in order.

An agent hands its stream to :meth:`BatchExecutor.run`; each batch is planned and performed
by the service's ``handle`` (outputs sent, dead letters written, table writes kept
pending). The consumer runs :meth:`BatchExecutor.persist` before every commit and before
partitions are revoked, and the forgetting and the assignment step on every rebalance
(:class:`.transport.BatchingConsumer`, rule 6). Executors are installed when the app is
built (:meth:`BatchExecutor.install`), never from an agent's body.

The order of a commit, the order a kill -9 recovery equal to a replay needs
(docs/decisions/processors-transport.md, *Durable before committed*; the persist's rules in
``pipeline.services.processors.persisting``):

1. every output the pending batches sent is acknowledged (a partition with an output that
   failed is given up and read again from its committed offset; a refused output stops
   the worker);
2. the node writes are made and acknowledged (the producer's flush; a lost write stops
   the worker);
3. the session records and cursors are written;
4. the batches' spans are marked folded (a slice at a time, the event loop free between);
5. the producer is flushed (every write above acknowledged) and the spans with it;
6. :func:`.commit_rule.commit_offset` moves the committed offset over the done spans.

Steps 1-4 are the pending writes' (:meth:`Pending.persist`, handed the flush of step 2 and
reporting what failed as a :class:`PersistOutcome`); 5 and 6 are the consumer's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pipeline.adapters.faust.failures import (
    FailureCount,
    WorkerStop,
    fold_again,
    folding_again_on_failure,
    stop_refused,
    stop_write_lost,
)
from pipeline.adapters.faust.transport import (
    BatchingTransport,
    mark_folded,
    mark_received,
    records_of,
    release_records,
)

log = logging.getLogger(__name__)

Flush = Callable[[], Awaitable[None]]
# Plans and performs one batch of one partition (its records in offset order, and the
# batch itself, which a later persist reports folded when the executor has pending
# writes; without, the batch is folded when this returns).
Handle = Callable[[Sequence[Any], Any], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]
# Batches marked folded between two yields to the event loop: a mark holds its batch's
# event and message, and a commit's worth (~1,400 batches at 5,000 events/s) freed in one
# go held the event loop for ~10 ms (measured after a persist).
MARK_SLICE: Final = 128


@dataclass(slots=True)
class PersistOutcome:
    """What failed in a persist: partitions given up to be read again (an output
    unacknowledged), an output the broker refused, a table write lost (the partitions of
    the last two are given up too, and the worker stops: they are not read again)."""

    given_up: list[tuple[int, Exception]] = field(default_factory=list)
    refused: Exception | None = None
    lost_write: Exception | None = None
    folded: list[Any] = field(default_factory=list)   # the batches written, fold order


class Pending(Protocol):
    """The table writes the batches of an agent keep until the next commit."""

    async def persist(self, flush: Flush) -> PersistOutcome: ...
    async def forget(self) -> None: ...


class BatchExecutor:
    """Runs one batched agent: its batches, its part of every commit and rebalance."""

    def __init__(self, app: Any, topic: str, handle: Handle, *, stop: WorkerStop,
                 counters: FailureCount, principal: str, pending: Pending | None = None,
                 on_assignment: Hook | None = None, producer_buffer: int | None = None
                 ) -> None:
        self.app = app
        self.topic = topic
        self.handle = handle
        self.stop = stop
        self.counters = counters
        self.principal = principal   # named when the broker refuses an output
        self.pending = pending
        self.on_assignment = on_assignment
        # Table writes wait in faust's producer buffer; past its ``max_messages`` faust
        # stops fetching until it drained (100 by default: a few batches' writes, so every
        # batch would stall the next fetch).
        self.producer_buffer = producer_buffer

    def install(self) -> None:
        """Make the consumer run this executor's commit and rebalance steps (call once the
        batching transport is installed)."""
        transport = self.app.transport
        if not isinstance(transport, BatchingTransport):
            raise RuntimeError("the batching transport is not installed")
        transport.executors[self.topic] = self

    async def run(self, stream: Any) -> None:
        """The agent's body: every batch taken, planned and performed; a batch that fails
        is folded again (:func:`.failures.folding_again_on_failure`)."""
        if self.producer_buffer is not None:   # the agents run once the producer exists
            self.app.producer.buffer.max_messages = self.producer_buffer
        async for event in stream.events():
            if not mark_received(self.app, event.message):
                continue   # its records come again (transport: fetched again)
            async with folding_again_on_failure(event, self.counters, self.stop):
                await self.handle(records_of(event.message), event)
            if self.pending is None:
                mark_folded(self.app, event)   # nothing pending: its writes are made
            release_records(event.message)

    async def persist(self) -> None:
        """Steps 1-4 of a commit (the module doc), and what a failure of each means."""
        if self.pending is None:
            return
        outcome = await self.pending.persist(self.app.producer.flush)
        if outcome.refused is not None:
            stop_refused(self.stop, self.principal, outcome.refused)
        if outcome.lost_write is not None:
            stop_write_lost(self.stop, outcome.lost_write)
        for partition, error in outcome.given_up:
            fold_again(self.stop, self.topic, partition, error)
        folded = outcome.folded
        while folded:   # a slice at a time, each freed once marked
            for event in folded[:MARK_SLICE]:
                mark_folded(self.app, event)
            del folded[:MARK_SLICE]
            await asyncio.sleep(0)

    async def forget(self) -> None:
        """Partitions moved: what is pending is dropped (the owners fold it again)."""
        if self.pending is not None:
            await self.pending.forget()

    async def assigned(self) -> None:
        """Partitions were assigned, before any is fetched (after :meth:`forget`)."""
        if self.on_assignment is not None:
            await self.on_assignment()
