"""The table writes of performed batch plans, kept until the next commit and written then.

A table value only has to be durable once an offset that claims it is committed, so the
executor (:mod:`.executor`) keeps, per partition, what the performed plans changed since the
last commit (:class:`PendingWrites`) and writes it when the commit begins (the consumer runs
the executor's persist first, and before partitions are revoked). One session's record is
then written once per commit, not once per fetched batch, and no batch waits for a broker
round trip before the next one is folded. Measured at 5,000 events/s
(``bench/bench_processors.py``): per-batch writes were ~3,000 changelog records/s and each
batch waited ~4 ms for its outputs' acknowledgements, which kept the agent busy 55% of the
time and queued the batches behind it.

What is kept is plain data: per key (a session) one record to write (any value with a
``to_json()``, taken as JSON by the persist) or one cursor (``chunk_marks``), node records
(``nodes``; None: delete), the outputs' deliveries and the batches to report folded.

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
  committed), their sessions' cached states dropped from the planner's caches (the tables,
  or a record a persist still holds, are the truth again: :meth:`PendingWrites.taken`), and
  the outcome names it in ``given_up``: the worker reads the partition again from its
  committed offset and folds them again (:mod:`pipeline.adapters.faust.failures`).
- *A refusal stops the worker.* When the broker refused an output (the principal lost an
  ACL), the partition is given up as above and the outcome says ``refused``: no later
  batch could be written either, so the worker stops (nothing given up is ever committed).

Persists run one at a time; each takes the changes under :attr:`PendingWrites.lock` (held
while a batch is planned and performed: no batch is half folded then) as JSON copies, so
the folds go on while it waits for acknowledgements. faust's tables take a write's
changelog partition from the current event, so each partition's records are written in a
context copied while one of its batches was performed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from pipeline.adapters.kafka.errors import is_refusal

log = logging.getLogger(__name__)

# Between two yields to the event loop, so that the folds go on during a persist: table
# writes; outputs acknowledged (then dropped).
WRITE_SLICE: Final = 32
SLICE: Final = 128
_Item = TypeVar("_Item")

Flush = Callable[[], Awaitable[None]]
Table = MutableMapping[str, Any]


class Recordable(Protocol):
    """A record to write: its table value is its JSON, taken when a persist begins."""

    def to_json(self) -> Any: ...


class PendingTables(Protocol):
    """The tables the writes go to (``sessions`` and ``chunk_marks`` by key, ``nodes``)."""

    @property
    def sessions(self) -> Table: ...
    @property
    def nodes(self) -> Table: ...
    @property
    def chunk_marks(self) -> Table: ...


class Caches(Protocol):
    """The planner's in-memory state that runs ahead of the tables: what it cached of a
    session given up is dropped (it continues from :meth:`PendingWrites.taken` or the
    tables)."""

    @property
    def states(self) -> MutableMapping[str, Any]: ...
    @property
    def cursors(self) -> MutableMapping[str, int]: ...


class WriteCounts(Protocol):
    failed_batches: int


@dataclass(slots=True)
class PersistOutcome:
    """What failed in a persist: partitions given up to be read again (an output
    unacknowledged), an output the broker refused, a table write lost (the partitions of
    the last two are given up too, and the worker stops: they are not read again)."""

    given_up: list[tuple[int, Exception]] = field(default_factory=list)
    refused: Exception | None = None
    lost_write: Exception | None = None
    folded: list[Any] = field(default_factory=list)   # the batches written, fold order


@dataclass(slots=True)
class PartitionChanges:
    """What the plans of one partition changed since its last persist."""

    records: dict[str, Recordable] = field(default_factory=dict)   # records to write
    marks: dict[str, int] = field(default_factory=dict)      # cursors moved by chunks only
    nodes: dict[str, Any] = field(default_factory=dict)      # node records; None: delete
    deliveries: list[Awaitable[object]] = field(default_factory=list)   # outputs sent
    # One per batch, fold order: the batch as the executor knows it (None: nobody waits)
    batches: list[Any] = field(default_factory=list)
    context: contextvars.Context | None = None

    def sessions(self) -> set[str]:
        return set(self.records) | set(self.marks)


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
        return cls(partition, {key: value.to_json() for key, value in changes.records.items()},
                   dict(changes.marks), changes.deliveries, changes.batches,
                   changes.context, changes.nodes)

    def sessions(self) -> set[str]:
        return set(self.records) | set(self.marks)

    async def write_nodes(self, tables: PendingTables) -> None:
        """Write the node records (acknowledged before :meth:`write_records`)."""
        await self._write([(tables.nodes, key, node) for key, node in self.nodes.items()])

    async def write_records(self, tables: PendingTables) -> None:
        """Write the session records and chunk cursors."""
        await self._write([
            *((tables.sessions, key, record) for key, record in self.records.items()),
            *((tables.chunk_marks, key, cursor) for key, cursor in self.marks.items())])

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


class PendingWrites:
    """The performed plans' changes not yet in the tables, by partition, and their persist.

    ``caches``: the planner's (its cached states and cursors), from which a session given
    up is dropped; ``folded_to``: partition -> the last offset of its last batch performed
    whole (every record up to it is in the caches or the tables; cleared on any drop)."""

    def __init__(self, counters: WriteCounts, caches: Caches) -> None:
        self.counters = counters
        self.caches = caches
        self.lock = asyncio.Lock()           # held while a batch is planned and performed
        self.changes: dict[int, PartitionChanges] = {}
        self.folded_to: dict[int, int] = {}
        self._persisting = asyncio.Lock()
        self._taken: dict[str, PartitionWrites] = {}   # session -> writes a persist holds
        self._writing: list[PartitionWrites] = []       # what the persist running holds

    def of(self, partition: int) -> PartitionChanges:
        changes = self.changes.get(partition)
        if changes is None:
            changes = self.changes[partition] = PartitionChanges()
        return changes

    def add_nodes(self, partition: int, writes: list[tuple[str, Any]],
                  tables: PendingTables) -> None:
        """Node writes (in fold order) join the partition's pending ones; ``writes`` is
        drained."""
        for key, node in writes:
            self.set_node(partition, key, node, tables)
        writes.clear()

    def add(self, partition: int, records: Mapping[str, Recordable], marks: Mapping[str, int],
            deliveries: list[Awaitable[object]], batch: Any, *, folded_to: int) -> None:
        """A performed plan's changes join its partition's pending ones: per key its record
        (the one to write) or, when only a cursor moved and no record is pending, the
        cursor; its outputs' deliveries, and ``batch`` (reported folded by the persist that
        writes them; None: nobody waits for it); ``folded_to``: its last offset."""
        self.folded_to[partition] = folded_to
        changes = self.of(partition)
        for key, record in records.items():
            changes.records[key] = record
            changes.marks.pop(key, None)
        for key, cursor in marks.items():
            if key not in changes.records:   # the record pending holds the cursor
                changes.marks[key] = cursor
        changes.deliveries += deliveries
        changes.batches.append(batch)
        # faust's tables take a write's partition from the current event (a batch's)
        changes.context = contextvars.copy_context()

    def set_node(self, partition: int, key: str, node: Any, tables: PendingTables) -> None:
        """A node record to write at the next persist (``node`` None: delete it). A node
        written and deleted between two persists is never written at all."""
        nodes = self.of(partition).nodes
        if node is None and nodes.get(key) is not None and not self._anywhere(key, tables):
            del nodes[key]
        else:
            nodes[key] = node

    def _anywhere(self, key: str, tables: PendingTables) -> bool:
        return key in tables.nodes or any(key in w.nodes for w in self._writing)

    def node(self, partition: int, key: str, tables: PendingTables) -> Any:
        """The node record as the plans left it: newer than the table until persisted."""
        for nodes in (self.changes.get(partition, PartitionChanges()).nodes,
                      *(w.nodes for w in reversed(self._writing) if w.partition == partition)):
            if key in nodes:
                return nodes[key]
        return tables.nodes.get(key)

    def unwritten(self) -> set[str]:
        """Keys whose cached record is newer than their table record."""
        found = set(self._taken)
        for changes in self.changes.values():
            found |= changes.sessions()
        return found

    def taken(self, key: str) -> tuple[Any, int | None]:
        """The record (JSON) and the cursor a persist holds for the key and has not
        written yet ((None, None): none); newer than its table record until written."""
        writes = self._taken.get(key)
        if writes is None:
            return None, None
        return writes.records.get(key), writes.marks.get(key)

    async def persist(self, tables: PendingTables, flush: Flush | None = None
                      ) -> PersistOutcome:
        """Write every partition's changes to ``tables`` (outputs acknowledged first, then
        the nodes, acknowledged: ``flush`` returns once every table write made before it is,
        and raises when one was lost; then the records); their batches are reported folded
        in the outcome, in fold order. A partition whose outputs failed is given up.
        Returns what was folded and what failed. No ``flush``: a write is acknowledged when
        made (plain dicts: the unit tests)."""
        outcome = PersistOutcome()
        flush = flush or _nothing_to_flush
        async with self._persisting:
            async with self.lock:
                taken = [PartitionWrites.of(partition, changes)
                         for partition, changes in sorted(self.changes.items())]
                self.changes = {}
                self._taken = {key: writes for writes in taken for key in writes.sessions()}
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

    async def _write_nodes(self, writes: PartitionWrites, tables: PendingTables,
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

    async def _write_records(self, writes: PartitionWrites, tables: PendingTables) -> None:
        await writes.write_records(tables)
        for key in writes.sessions():
            self._taken.pop(key, None)

    def _give_up(self, writes: PartitionWrites, error: Exception) -> None:
        """Under the lock: the partition's batches taken and since are never marked folded."""
        for key in writes.sessions():
            self._taken.pop(key, None)
        later = self.changes.get(writes.partition)
        count = len(writes.batches) + (len(later.batches) if later else 0)
        self.give_up_partition(writes.partition, writes.sessions())
        self.counters.failed_batches += len(writes.batches)   # and the later ones, above
        log.error("partition %d: %d folded batches given up (%s: %s); they are folded "
                  "again from the committed offset", writes.partition, count,
                  type(error).__name__, error)

    def give_up_partition(self, partition: int, touched: Iterable[str] = ()) -> None:
        """Under the lock: drop a partition's changes (a batch of it failed) and what the
        caches hold of their sessions and of ``touched`` (a failed batch's)."""
        changes = self.changes.pop(partition, None)
        dropped = set(touched)
        if changes is not None:
            self.counters.failed_batches += len(changes.batches)
            dropped |= changes.sessions()
        self.drop(dropped)

    def drop(self, keys: Iterable[str]) -> None:
        """Forget what the caches hold of these keys: the planner continues them from the
        records a persist holds (:meth:`taken`) or from the tables."""
        self.folded_to.clear()   # no longer vouched for: the committed offsets still are
        for key in keys:
            self.caches.states.pop(key, None)
            self.caches.cursors.pop(key, None)

    def give_up_all(self) -> int:
        """Under the lock: drop every change and the caches (partitions moved; the next
        owner folds them again from the committed offset). Returns how many batches were
        dropped."""
        count = sum(len(changes.batches) for changes in self.changes.values())
        self.changes = {}
        self.caches.states.clear()
        self.caches.cursors.clear()
        self.folded_to.clear()
        return count
