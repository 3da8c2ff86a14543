"""The one executor of the processors' batch plans: what a batch and a commit do, in order.

The walk of a batch of the session topic, one pass down (docs/decisions/processors-transport.md,
*The batch walk*): the consumer (:mod:`.transport`) hands the batch to its agent,
:meth:`BatchExecutor.run`; :meth:`PlanExecutor.fold` has it planned by the pure batch step
(a :class:`Planner`: ``pipeline.services.processors.planning`` over core's folds), reads the
log back when the plan wants it and has the plan go on (as the driver's runner loops
``TurnMachine.next_effect``), then performs the plan here: outputs sent, dead letters
written (:class:`pipeline.adapters.kafka.dlq_book.DeadLetterBook`), table writes kept
pending (:class:`.pending.PendingWrites`). The service is reached only through the pure
planner (plain data in and out); no callback of the service runs from a commit or a rebalance.

The consumer runs :meth:`BatchExecutor.persist` before every commit and before
partitions are revoked, and the forgetting and the assignment step on every rebalance
(:class:`.transport.BatchingConsumer`, rule 6). Executors are installed when the app is
built (:meth:`BatchExecutor.install`), never from an agent's body.

The order of a commit, the order a kill -9 recovery equal to a replay needs
(docs/decisions/processors-transport.md, *Durable before committed*; the persist's rules in
:mod:`.pending`):

1. every output the pending batches sent is acknowledged (a partition with an output that
   failed is given up and read again from its committed offset; a refused output stops
   the worker);
2. the node writes are made and acknowledged (the producer's flush; a lost write stops
   the worker);
3. the session records and cursors are written;
4. the batches' spans are marked folded (a slice at a time, the event loop free between);
5. the producer is flushed (every write above acknowledged) and the spans with it;
6. :func:`.commit_rule.commit_offset` moves the committed offset over the done spans.

Steps 1-4 are the pending writes' (:meth:`PlanExecutor.persist`, handed the flush of step
2 and reporting what failed as a :class:`.pending.PersistOutcome`); 5 and 6 are the
consumer's.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, Generic, Protocol, TypeVar

from pipeline.adapters.faust.failures import (
    FailureCount,
    WorkerStop,
    fold_again,
    folding_again_on_failure,
    stop_refused,
    stop_write_lost,
)
from pipeline.adapters.faust.pending import (
    Caches,
    Flush,
    PendingTables,
    PendingWrites,
    PersistOutcome,
    Recordable,
)
from pipeline.adapters.faust.transport import (
    BatchingTransport,
    mark_folded,
    mark_received,
    records_of,
    release_records,
)
from pipeline.adapters.kafka.dlq_book import DeadLetterBook
from pipeline.adapters.kafka.records import OutRecord

log = logging.getLogger(__name__)

__all__ = ["BatchExecutor", "Flush", "Handle", "PersistOutcome", "PlanExecutor", "Planner"]

# Plans and performs one batch of one partition (its records in offset order, and the
# batch itself, which a later persist reports folded when the executor has pending
# writes; without, the batch is folded when this returns).
Handle = Callable[[Sequence[Any], Any], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]
# Returns, when the sender has one, the record's delivery (awaitable until the broker
# acknowledged it): see *Outputs before state* in :mod:`.pending`.
Send = Callable[[OutRecord], Awaitable[object]]
# (partition, session, first seq wanted, below offset) -> the session's records from that
# seq on below that offset, one per seq in seq order (the heal's read of the log:
# :func:`pipeline.adapters.kafka.session_span.session_records_before` in the worker).
ReadBack = Callable[[int, str, int, int], Awaitable[Sequence[Any]]]
# (partition, offset of a batch's first record) -> once the batch may be folded (the
# projection handover's gate: :class:`pipeline.adapters.kafka.projection_follow.ProjectionFollow`)
Gate = Callable[[int, int], Awaitable[object]]
# Batches marked folded between two yields to the event loop: a mark holds its batch's
# event and message, and a commit's worth (~1,400 batches at 5,000 events/s) freed in one
# go held the event loop for ~10 ms (measured after a persist).
MARK_SLICE: Final = 128


class Wanted(Protocol):
    """Records a plan wants read back before it goes on (see :data:`ReadBack`)."""

    @property
    def partition(self) -> int: ...
    @property
    def session_id(self) -> str: ...
    @property
    def from_seq(self) -> int: ...
    @property
    def before_offset(self) -> int: ...


class Plan(Protocol):
    """What one batch changes, in the order the executor performs it."""

    @property
    def partition(self) -> int: ...
    @property
    def span(self) -> tuple[int, int]: ...   # its records' offsets: first, last + 1
    @property
    def wants(self) -> Wanted | None: ...
    @property
    def outputs(self) -> list[OutRecord]: ...
    @property
    def letters(self) -> list[tuple[Any, Exception]]: ...
    @property
    def node_writes(self) -> list[tuple[str, Any]]: ...   # fold order; None: delete
    @property
    def to_write(self) -> Mapping[str, Recordable]: ...   # by session: the record to write
    @property
    def marks(self) -> Mapping[str, int]: ...             # cursors moved by chunks only

    def sessions(self) -> set[str]: ...                   # every session it touched


PlanT = TypeVar("PlanT", bound=Plan)


class Planner(Caches, Protocol[PlanT]):
    """The pure batch step: plans never await and do no I/O; their tables are read only."""

    @property
    def tables(self) -> PendingTables: ...

    def start(self, records: Sequence[Any]) -> PlanT: ...
    # Folds ``found`` (what ``plan.wants`` asked for; None at the start), then the rest.
    def go_on(self, plan: PlanT, found: Sequence[Any] | None = None) -> PlanT: ...


class PlanExecutor(Generic[PlanT]):
    """Plans each batch of the session topic with ``planner`` and performs the plan; keeps
    its table writes until the next persist (:class:`.pending.PendingWrites`)."""

    def __init__(self, planner: Planner[PlanT], send: Send, letters: DeadLetterBook,
                 pending: PendingWrites, *, read_back: ReadBack | None = None,
                 gate: Gate | None = None) -> None:
        self.planner = planner
        self.send = send
        self.letters = letters
        self.pending = pending
        self.read_back = read_back   # None: a plan never wants a read (gaps reported)
        self.gate = gate             # passed once per batch, before it is planned

    async def fold(self, records: Sequence[Any], batch: Any = None) -> None:
        """Plan the records of one partition (in order) and perform the plan. What they
        change is written to the tables by the next :meth:`persist`, whose outcome reports
        ``batch`` folded then (None: nobody waits for it)."""
        if not records:
            return
        first = records[0]
        self.letters.folding(first.partition, first.offset)
        if self.gate is not None:
            await self.gate(first.partition, first.offset)
        async with self.pending.lock:
            plan = self.planner.start(records)
            try:
                self.planner.go_on(plan)
                while plan.wants is not None:
                    await self._read_back(plan, plan.wants)
                await self._perform(plan, batch)
            except BaseException:
                # The cached states of the partition may hold changes half made: the
                # partition's unpersisted batches are given up with this one.
                self.letters.drop_batch()
                self.pending.give_up_partition(first.partition, plan.sessions())
                raise

    async def _read_back(self, plan: PlanT, wanted: Wanted) -> None:
        """The records the plan wants, read from the log, and the plan gone on with them;
        its node writes so far join the pending ones first (views read them meanwhile)."""
        if self.read_back is None:
            raise RuntimeError("a plan wants records read back and there is no reader")
        self.pending.add_nodes(plan.partition, plan.node_writes, self.planner.tables)
        found = await self.read_back(wanted.partition, wanted.session_id, wanted.from_seq,
                                     wanted.before_offset)
        self.planner.go_on(plan, found)

    async def _perform(self, plan: PlanT, batch: Any) -> None:
        """Outputs sent, dead letters written, then the plan's table writes join its
        partition's pending ones."""
        self.pending.add_nodes(plan.partition, plan.node_writes, self.planner.tables)
        deliveries: list[Awaitable[object]] = []
        send = partial(self._send_one, deliveries)
        for out in plan.outputs:
            await send(out)
        for record, error in plan.letters:   # without a sink (unit tests): as outputs
            await self.letters.letter(record, error, send)
        await self.letters.write_batch(plan.partition)
        self.pending.add(plan.partition, plan.to_write, plan.marks, deliveries, batch,
                         folded_to=plan.span[1] - 1)

    async def _send_one(self, deliveries: list[Awaitable[object]], out: OutRecord) -> None:
        """An output of the batch (or a dead letter without a sink); its delivery joins
        ``deliveries``, awaited before the batch's state is written."""
        delivery = await self.send(out)
        if inspect.isawaitable(delivery):
            deliveries.append(delivery)

    async def persist(self, flush: Flush | None = None) -> PersistOutcome:
        """Steps 1-4 of a commit: what the plans changed, written to the tables (see
        :mod:`.pending`); ``flush``: until every table write made before it is
        acknowledged (the producer's), nothing to wait for with plain dicts."""
        return await self.pending.persist(self.planner.tables, flush)

    async def forget(self) -> None:
        """Drop what is cached in memory and not persisted (partitions moved: others fold
        them from the committed offset)."""
        async with self.pending.lock:
            dropped = self.pending.give_up_all()
            self.letters.forget()
        if dropped:
            log.info("%d folded batches not persisted before the rebalance: their "
                     "partitions' owners fold them again from the committed offset", dropped)


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
