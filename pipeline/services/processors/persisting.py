"""What the session folds changed, written to the tables right before each commit.

A table value only has to be durable once an offset that claims it is committed, so the
folds keep, per partition, what they changed since the last commit (:class:`ChangeBook`) and
write it when the commit begins (the worker's consumer calls :meth:`ChangeBook.persist`
first, and before partitions are revoked). One session's record is then written once per
commit, not once per fetched batch, and no batch waits for a broker round trip before the
next one is folded. Measured at 5,000 events/s (``bench/bench_processors.py``): per-batch
writes were ~3,000 changelog records/s and each batch waited ~4 ms for its outputs'
acknowledgements, which kept the agent busy 55% of the time and queued the batches behind it.

Rules (each one keeps a kill -9 equal to a replay):

- *Outputs before state.* A session's record says which seqs its outputs were sent for; it
  is written only once every output the partition's batches sent is acknowledged, so a
  crash can only repeat outputs, never lose one that a record claims.
- *State before commit.* A batch is reported folded (in the outcome's ``folded``, which the
  executor marks: outputs acknowledged, state written) only after its partition's records
  are written; the commit that follows flushes
  them before it commits (:mod:`pipeline.adapters.faust.commit_rule`).
- *Nodes acknowledged before records, and only live ones.* The ``nodes`` records (one per
  live surface node's message) are written by the persist too, and the session records only
  once every node write is acknowledged (the ``flush`` the persist is given): the tables'
  changelogs are different topics, each partition with its own leader, so a kill -9 can
  lose any subset of writes still unacknowledged, not only a suffix. A record that
  survives a crash finds the nodes it names; nodes without their record are written again
  by the refold (the same keys and values). A node both appended and taken off the surface
  between two persists is never written, nor deleted.
- *A lost table write stops the worker.* When the flush raises (a table write was not
  acknowledged), the tables this worker holds are ahead of their changelogs: nothing of
  the persist is marked folded and the outcome says ``lost_write``, so the worker stops and
  its next start restores the tables from the changelogs.
- *One record per session.* Everything the batches decided for a session since the last
  persist is one ``sessions`` record (or one ``chunk_marks`` cursor when only chunks moved
  it): after a crash a session holds all of it or none, and redelivery from the committed
  offset skips what it holds.
- *A partition fails alone.* When an output of a partition was not acknowledged, that
  partition's batches since its last persist are given up: never marked folded (so not
  committed), their sessions' cached states dropped (the tables are the truth again), and
  the outcome names it in ``given_up``: the worker reads the partition again from its
  committed offset and folds them again (:mod:`pipeline.adapters.faust.failures`).
- *A refusal stops the worker.* When the broker refused an output (the principal lost an
  ACL), the partition is given up as above and the outcome says ``refused``: no later
  batch could be written either, so the worker stops (nothing given up is ever committed).

The worker performs the outcome (:class:`pipeline.adapters.faust.executor.BatchExecutor`,
which runs each persist before the commit, in the order its module states).

Persists run one at a time; each takes the changes under the folder's lock (no batch is
half folded then) as JSON copies, so the folds go on while it waits for acknowledgements.
faust's tables take a write's changelog partition from the current event, so each
partition's records are written in a context copied while one of its batches was folded.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from pipeline.adapters.faust.executor import Flush, PersistOutcome
from pipeline.adapters.kafka.errors import is_refusal
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.planning import BatchPlan
from pipeline.services.processors.session_state import SessionState, SessionTables, Table

log = logging.getLogger(__name__)

# Between two yields to the event loop, so that the folds go on during a persist: table
# writes; outputs acknowledged (then dropped).
WRITE_SLICE: Final = 32
SLICE: Final = 128
_Item = TypeVar("_Item")


@dataclass(slots=True)
class PartitionChanges:
    """What the folds of one partition changed since its last persist."""

    states: dict[str, SessionState] = field(default_factory=dict)   # records to write
    marks: dict[str, int] = field(default_factory=dict)      # cursors moved by chunks only
    nodes: dict[str, Any] = field(default_factory=dict)      # node records; None: delete
    deliveries: list[Awaitable[object]] = field(default_factory=list)   # outputs sent
    # One per batch, fold order: the batch as the executor knows it (None: nobody waits)
    batches: list[Any] = field(default_factory=list)
    context: contextvars.Context | None = None

    def sessions(self) -> set[str]:
        return set(self.states) | set(self.marks)


@dataclass(frozen=True, slots=True)
class PartitionWrites:
    """One partition's changes as a persist took them: the records as JSON values then."""

    partition: int
    records: dict[str, Any]
    marks: dict[str, int]
    deliveries: list[Awaitable[object]]
    batches: list[Any]
    context: contextvars.Context | None
    nodes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, partition: int, changes: PartitionChanges) -> PartitionWrites:
        return cls(partition, {sid: state.to_json() for sid, state in changes.states.items()},
                   dict(changes.marks), changes.deliveries, changes.batches,
                   changes.context, changes.nodes)

    def sessions(self) -> set[str]:
        return set(self.records) | set(self.marks)

    async def write_nodes(self, tables: SessionTables) -> None:
        """Write the node records (acknowledged before :meth:`write_records`)."""
        await self._write([(tables.nodes, key, node) for key, node in self.nodes.items()])

    async def write_records(self, tables: SessionTables) -> None:
        """Write the session records and chunk cursors."""
        await self._write([
            *((tables.sessions, sid, record) for sid, record in self.records.items()),
            *((tables.chunk_marks, sid, cursor) for sid, cursor in self.marks.items())])

    async def _write(self, items: list[tuple[Table, str, Any]]) -> None:
        """Write ``items``, a slice at a time (a commit writes every session a few seconds
        of folds touched: in one go that stalled the folds and fetches for ms)."""
        for start in range(0, len(items), WRITE_SLICE):
            if start:
                await asyncio.sleep(0)
            part = items[start:start + WRITE_SLICE]
            if self.context is None:
                _write(part)
            else:
                self.context.run(_write, part)


async def _nothing_to_flush() -> None:
    """A table write is acknowledged when made (plain dicts: the unit tests)."""


async def _acknowledged(deliveries: list[Awaitable[object]]) -> None:
    """Until every output is acknowledged (raises the first that failed), one by one: most
    are by now, and awaiting a done future does not suspend (a gather registered a callback
    on each of the ~1,700 a commit finds at 5,000 events/s, all run in one loop turn)."""
    async for part in _in_slices(deliveries):
        for delivery in part:
            await delivery


async def _in_slices(items: list[_Item]) -> AsyncIterator[list[_Item]]:
    """``items`` a slice at a time, each removed from the list (and so freed) once the
    caller is through with it, with a yield to the event loop in between. A slice the
    caller raised on stays in the list."""
    while items:
        yield items[:SLICE]
        del items[:SLICE]
        await asyncio.sleep(0)


def _quiet(deliveries: Iterable[Awaitable[object]]) -> None:
    """The outputs of a partition given up may fail too: one failure is reported (the
    partition's), not one "exception never retrieved" per later output."""
    for delivery in deliveries:
        if isinstance(delivery, asyncio.Future):
            delivery.add_done_callback(_retrieved)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _write(items: list[tuple[Table, str, Any]]) -> None:
    for table, key, value in items:
        if value is None:
            table.pop(key, None)   # a tombstone in the changelog
        else:
            table[key] = value


class ChangeBook:
    """The folds' changes not yet in the tables, by partition, and their persist."""

    def __init__(self, counters: DeliveryCounters,
                 drop_sessions: Callable[[Iterable[str]], None]) -> None:
        self.counters = counters
        self.drop_sessions = drop_sessions   # the folder's cached states of these are void
        self.lock = asyncio.Lock()           # held while a batch is folded
        self.changes: dict[int, PartitionChanges] = {}
        self._persisting = asyncio.Lock()
        self._taken: dict[str, PartitionWrites] = {}   # session -> writes a persist holds
        self._writing: list[PartitionWrites] = []       # what the persist running holds

    def of(self, partition: int) -> PartitionChanges:
        changes = self.changes.get(partition)
        if changes is None:
            changes = self.changes[partition] = PartitionChanges()
        return changes

    def add_nodes(self, plan: BatchPlan, tables: SessionTables) -> None:
        """The plan's node writes so far join its partition's pending ones (drained from
        the plan), in fold order."""
        for key, node in plan.node_writes:
            self.set_node(plan.partition, key, node, tables)
        plan.node_writes.clear()

    def add(self, plan: BatchPlan, tables: SessionTables,
            deliveries: list[Awaitable[object]], batch: Any) -> None:
        """A performed plan's changes join its partition's pending ones: per session its
        state (the one record to write) or, when only chunks moved it, its cursor; its
        outputs' deliveries, and ``batch`` (reported folded by the persist that writes
        them; None: nobody waits for it)."""
        self.add_nodes(plan, tables)
        changes = self.of(plan.partition)
        for session_id, started in plan.started.items():
            cursor = plan.cursors[session_id]
            state = (plan.states[session_id] if session_id in plan.dirty
                     else changes.states.get(session_id))
            if state is not None:
                state.next_seq = max(state.next_seq, cursor)
                changes.states[session_id] = state
                changes.marks.pop(session_id, None)
            elif cursor > started:
                changes.marks[session_id] = cursor
        tables.chunks.update(plan.cursors)
        changes.deliveries += deliveries
        changes.batches.append(batch)
        # faust's tables take a write's partition from the current event (a batch's)
        changes.context = contextvars.copy_context()

    def set_node(self, partition: int, key: str, node: Any, tables: SessionTables) -> None:
        """A node record to write at the next persist (``node`` None: delete it). A node
        written and deleted between two persists is never written at all."""
        nodes = self.of(partition).nodes
        if node is None and nodes.get(key) is not None and not self._anywhere(key, tables):
            del nodes[key]
        else:
            nodes[key] = node

    def _anywhere(self, key: str, tables: SessionTables) -> bool:
        return key in tables.nodes or any(key in w.nodes for w in self._writing)

    def node(self, partition: int, key: str, tables: SessionTables) -> Any:
        """The node record as the folds left it: newer than the table until persisted."""
        for nodes in (self.changes.get(partition, PartitionChanges()).nodes,
                      *(w.nodes for w in reversed(self._writing) if w.partition == partition)):
            if key in nodes:
                return nodes[key]
        return tables.nodes.get(key)

    def unwritten(self) -> set[str]:
        """Sessions whose cached state is newer than their table record."""
        found = set(self._taken)
        for changes in self.changes.values():
            found |= changes.sessions()
        return found

    def taken(self, session_id: str) -> tuple[Any, int | None]:
        """The record and the cursor a persist holds for the session and has not written
        yet ((None, None): none); newer than its table record until written."""
        writes = self._taken.get(session_id)
        if writes is None:
            return None, None
        return writes.records.get(session_id), writes.marks.get(session_id)

    async def persist(self, tables: SessionTables, flush: Flush = _nothing_to_flush
                      ) -> PersistOutcome:
        """Write every partition's changes to ``tables`` (outputs acknowledged first, then
        the nodes, acknowledged: ``flush`` returns once every table write made before it is,
        and raises when one was lost; then the records); their batches are reported folded
        in the outcome, in fold order. A partition whose outputs failed is given up.
        Returns what was folded and what failed."""
        outcome = PersistOutcome()
        async with self._persisting:
            async with self.lock:
                taken = [PartitionWrites.of(partition, changes)
                         for partition, changes in sorted(self.changes.items())]
                self.changes = {}
                self._taken = {sid: writes for writes in taken for sid in writes.sessions()}
                self._writing = taken
            try:
                written = [writes for writes in taken
                           if await self._write_nodes(writes, tables, outcome)]
                if await self._nodes_acknowledged(written, flush, outcome):
                    for writes in written:
                        await self._write_records(writes, tables)
                        outcome.folded += [b for b in writes.batches if b is not None]
            finally:
                self._taken, self._writing = {}, []
        return outcome

    async def _write_nodes(self, writes: PartitionWrites, tables: SessionTables,
                           outcome: PersistOutcome) -> bool:
        """The partition's outputs acknowledged, its nodes written; False: given up."""
        try:
            await _acknowledged(writes.deliveries)
            await writes.write_nodes(tables)
        except Exception as exc:
            _quiet(writes.deliveries)
            async with self.lock:
                self._give_up(writes, exc)
            if is_refusal(exc):
                outcome.refused = outcome.refused or exc
            else:
                outcome.given_up.append((writes.partition, exc))
            return False
        return True

    async def _nodes_acknowledged(self, written: list[PartitionWrites], flush: Flush,
                                  outcome: PersistOutcome) -> bool:
        """Until the node writes are acknowledged; False (every partition given up, the
        worker told to stop) when a table write was lost."""
        if not any(writes.nodes for writes in written):
            return True
        try:
            await flush()
        except Exception as exc:
            async with self.lock:
                for writes in written:
                    self._give_up(writes, exc)
            outcome.lost_write = exc
            return False
        return True

    async def _write_records(self, writes: PartitionWrites, tables: SessionTables) -> None:
        await writes.write_records(tables)
        for sid in writes.sessions():
            self._taken.pop(sid, None)

    def _give_up(self, writes: PartitionWrites, error: Exception) -> None:
        """Under the lock: the partition's batches taken and since are never marked folded."""
        for sid in writes.sessions():
            self._taken.pop(sid, None)
        later = self.changes.get(writes.partition)
        count = len(writes.batches) + (len(later.batches) if later else 0)
        self.drop_sessions(writes.sessions() | self.give_up_partition(writes.partition))
        self.counters.failed_batches += len(writes.batches)   # and the later ones, above
        log.error("partition %d: %d folded batches given up (%s: %s); they are folded "
                  "again from the committed offset", writes.partition, count,
                  type(error).__name__, error)

    def give_up_partition(self, partition: int) -> set[str]:
        """Under the lock: drop a partition's changes (its batch failed); returns the
        sessions they touched."""
        changes = self.changes.pop(partition, None)
        if changes is None:
            return set()
        self.counters.failed_batches += len(changes.batches)
        return changes.sessions()

    def give_up_all(self) -> int:
        """Under the lock: drop every change (partitions moved; the next owner folds them
        again from the committed offset). Returns how many batches were dropped."""
        count = sum(len(changes.batches) for changes in self.changes.values())
        self.changes = {}
        return count
