"""Session-topic records -> published changes and table updates, one fetched batch at a time.

The decisions are the pure batch step's (:func:`.planning.plan_batch`, over core's folds);
this module performs its plans: reads the log back when a plan wants it, sends the outputs,
writes the dead letters, and hands the table writes to the next persist.
Tables are plain ``MutableMapping`` values here (faust tables in the worker, dicts in unit
tests); sending goes through one ``Send`` callable (faust's producer in the worker). The
worker hands over everything one fetch returned for a partition (see
:mod:`pipeline.adapters.faust.transport`);
:meth:`SessionFolder.handle` is the same for a single record.

Delivery rules (DESIGN.md section 2): a seq below the next expected one is a duplicate
(skipped, counted). A seq above it means the worker's state is behind the log, and **the
log is right**: the worker reads the session's missing records back from the session topic
(``read_back``, a search back bounded by the session's own span) and folds them, with a
metric and a log line naming the session (:mod:`.planning`). Only a gap the log
itself has, or one after an event the session stopped at, is reported (counted, logged,
dead-lettered with the reason, never folded past). An ``assistant/chunk`` is recognised by
its ``dsh.type`` header and only advances the session's cursor, without being decoded; a
record that does not decode, or an event that breaks a surface rule, is dead-lettered and
processing goes on. So is an event after which the session's table records could exceed
the producer's record limit (:func:`.session_state.refuse_oversize`): its session stops
there, like at a broken rule. A record is dead-lettered at most once (:mod:`.dead_letters`).

**Crash consistency** (the rules are :mod:`.persisting`'s): a batch's offsets are committed
only once its outputs are acknowledged and its table writes made and acknowledged (nodes
before the session records that name them). Everything the batches decide for one session
is ONE ``sessions`` record, written once per commit: after a crash it holds all of the
session's events since the previous commit or none, and redelivery from the committed
offset skips what it holds and applies the rest once. ``nodes`` holds the projected message
of each LIVE surface node only; nothing a session keeps grows with its number of events
(``?at_seq=`` is read back from the session topic). Outputs are sent at once, so a crash can
only repeat them (same key and value on the compacted topics; the per-model stage drops a
repeated sample by seq). Fleet status and session usage are published once per session per
batch, derived-message changes one record per change; values are Avro
(:mod:`pipeline.codec.outputs`), usage samples to the internal per-model topic JSON.

**Chunks and gaps after a kill -9.** Chunks (about 80% of the records) change no table but
move the session's cursor. At every persist the cursor of each session they moved is
written: in the ``sessions`` record when that is written anyway, else in the small
``chunk_marks`` table (one write per session per commit, not per chunk). So at every committed
offset the tables know exactly which seq each session expects next, and the first record
redelivered after a restart is judged against that: a missing seq is a gap whether or not a
restart fell next to it. (The alternative, accepting a jump over the chunk seqs that the next
``assistant/message`` lists in ``sourceEventSeqs``, would report false gaps: the chunks of a
failed provider attempt, or of a stream cut by a crash and closed by crash repair, are listed
by no message.) Cursors are also cached in memory (``SessionTables.chunks``) together with
the decoded states; both run ahead of the tables until the next persist (the HTTP views read
them, :meth:`SessionFolder.current`) and are dropped on every rebalance.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Final, Protocol

from pipeline.adapters.faust.executor import Flush, PersistOutcome
from pipeline.adapters.kafka.dlq import MAX_RECORD_BYTES
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.outputs import OutputCodecs, default_output_codecs
from pipeline.codec.records import ConsumedRecord
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.dead_letters import (
    DeadLetterBook,
    DeadLettered,
    DeadLetterSink,
)
from pipeline.services.processors.persisting import ChangeBook
from pipeline.services.processors.planning import (
    BatchPlan,
    Decoder,
    DerivedTopics,
    FoldState,
    continue_plan,
)
from pipeline.services.processors.session_state import SessionState, SessionTables
from pipeline.settings import TopicNames

log = logging.getLogger(__name__)

STATE_CACHE_MAX: Final = 50_000  # decoded session states kept (beyond the unpersisted ones)

__all__ = ["STATE_CACHE_MAX", "Decoder", "ReadBack", "Send", "SessionFolder"]

# Returns, when the sender has one, the record's delivery (awaitable until the broker
# acknowledged it): see *Outputs before state* in :mod:`.persisting`.
Send = Callable[[OutRecord], Awaitable[object]]


# (partition, session, first seq wanted, below offset) -> the session's records from that
# seq on below that offset, one per seq in seq order (the heal's read of the log:
# :func:`pipeline.adapters.kafka.session_span.session_records_before` in the worker).
ReadBack = Callable[[int, str, int, int], Awaitable[Sequence[ConsumedRecord]]]


class DerivedRoute(DerivedTopics, Protocol):
    """:class:`.planning.DerivedTopics` with the wait a batch passes first (a
    :class:`.projection_follow.ProjectionFollow` in the worker)."""

    async def gate(self, partition: int, offset: int) -> str | None: ...


class SessionFolder:
    """Folds session-topic records into the session tables: plans each batch
    (:func:`.planning.plan_batch`) and performs the plan."""

    def __init__(self, tables: SessionTables, send: Send, decode: Decoder, topics: TopicNames,
                 usage_topic: str, counters: DeliveryCounters,
                 route: DerivedRoute | None = None, *,
                 outputs: OutputCodecs | None = None,
                 max_record_bytes: int = MAX_RECORD_BYTES,
                 dead_lettered: DeadLettered | None = None,
                 read_back: ReadBack | None = None,
                 dead_letter_sink: DeadLetterSink | None = None) -> None:
        # Avro encoders of the output topics (single-object encoding unless given ones
        # with registry ids); the internal usage-by-model topic stays JSON.
        self.fold = FoldState(tables, decode, topics, usage_topic,
                              outputs or default_output_codecs(), counters, max_record_bytes,
                              route, can_heal=read_back is not None)
        self._read_back = read_back   # the heal's reader of the log (None: gaps reported)
        self.route = route  # None: always the derived-messages topic of ``topics``
        self.send = send
        self.counters = counters
        # partition -> the last offset of its last batch folded whole: every record up to
        # it is in ``states`` or the tables (dropped with any cached state given up).
        self.folded_to: dict[int, int] = {}
        self._deliveries: list[Awaitable[object]] = []   # the batch's outputs sent
        self.book = ChangeBook(counters, self._drop_sessions)
        self.dead_letters = DeadLetterBook(dead_lettered, dead_letter_sink,
                                           send=self._send_one, counters=counters,
                                           max_record_bytes=max_record_bytes)

    @property
    def tables(self) -> SessionTables:
        return self.fold.tables

    @tables.setter
    def tables(self, tables: SessionTables) -> None:
        self.fold.tables = tables

    @property
    def states(self) -> dict[str, SessionState]:
        """The decoded sessions as folded so far (see :meth:`forget`)."""
        return self.fold.states

    @property
    def decode(self) -> Decoder:
        return self.fold.decode

    @decode.setter
    def decode(self, decode: Decoder) -> None:
        self.fold.decode = decode

    @property
    def outputs(self) -> OutputCodecs:
        return self.fold.outputs

    @outputs.setter
    def outputs(self, outputs: OutputCodecs) -> None:
        self.fold.outputs = outputs

    @property
    def route(self) -> DerivedRoute | None:
        return self._route

    @route.setter
    def route(self, route: DerivedRoute | None) -> None:
        self._route = self.fold.route = route

    @property
    def read_back(self) -> ReadBack | None:
        return self._read_back

    @read_back.setter
    def read_back(self, read_back: ReadBack | None) -> None:
        self._read_back, self.fold.can_heal = read_back, read_back is not None

    @property
    def max_record_bytes(self) -> int:
        """The producer's record limit: no table record, output or dead letter above it."""
        return self.fold.max_record_bytes

    @max_record_bytes.setter
    def max_record_bytes(self, limit: int) -> None:
        self.fold.max_record_bytes = self.dead_letters.max_record_bytes = limit

    async def persist(self, flush: Flush | None = None) -> PersistOutcome:
        """Write what the folds changed to the tables (see :mod:`.persisting`); ``flush``:
        until every table write made before it is acknowledged (the producer's), nothing to
        wait for with plain dicts."""
        if flush is None:
            return await self.book.persist(self.tables)
        return await self.book.persist(self.tables, flush)

    async def forget(self) -> None:
        """Drop what is cached in memory and not persisted (partitions moved: others fold
        them from the committed offset)."""
        async with self.book.lock:
            dropped = self.book.give_up_all()
            self.tables.chunks.clear()
            self.states.clear()
            self.folded_to.clear()
            self.dead_letters.forget()
        if dropped:
            log.info("%d folded batches not persisted before the rebalance: their "
                     "partitions' owners fold them again from the committed offset", dropped)

    def node(self, partition: int, key: str) -> Any:
        """A ``nodes`` record as folded so far (ahead of the table until the next persist)."""
        return self.book.node(partition, key, self.tables)

    def current(self, session_id: str) -> SessionState | None:
        """The session as folded so far (ahead of its table record until the next persist);
        None for a session without a record (unknown, or only chunks folded)."""
        state = self.states.get(session_id)
        if state is None:
            raw = self.tables.sessions.get(session_id)
            state = None if raw is None else SessionState.from_json(session_id, raw)
        return state

    async def handle(self, record: ConsumedRecord) -> None:
        await self.handle_batch((record,))

    async def handle_batch(self, records: Sequence[ConsumedRecord], batch: Any = None
                           ) -> None:
        """Plan the records of one partition (in order) and perform the plan. What they
        change is written to the tables by the next :meth:`persist`, whose outcome reports
        ``batch`` folded then (None: nobody waits for it). With a route, its gate is passed
        once per batch (it waits while a handover is pending)."""
        if not records:
            return
        first = records[0]
        self.dead_letters.folding(first.partition, first.offset)
        if self.route is not None:
            await self.route.gate(first.partition, first.offset)
        async with self.book.lock:
            plan = BatchPlan.of(records)
            try:
                await self._perform(plan, batch)
            except BaseException:
                # The cached states of the partition may hold changes half made: the
                # partition's unpersisted batches are given up with this one.
                self.dead_letters.drop_batch()
                self._drop_sessions(self.book.give_up_partition(first.partition)
                                    | set(plan.started))
                raise

    async def _perform(self, plan: BatchPlan, batch: Any) -> None:
        """The plan, made and performed: records read back while it wants them (its node
        writes so far pending first: views read them during the read), outputs sent, dead
        letters written, then its table writes join the partition's pending ones."""
        self.counters.records += len(plan.records)
        continue_plan(self.fold, plan)
        while plan.wants is not None:
            if self._read_back is None:
                raise RuntimeError("a plan wants records read back and there is no reader")
            self.book.add_nodes(plan, self.tables)
            wanted = plan.wants
            found = await self._read_back(wanted.partition, wanted.session_id,
                                          wanted.from_seq, wanted.before_offset)
            continue_plan(self.fold, plan, found)
        self.book.add_nodes(plan, self.tables)
        self._deliveries = []
        for out in plan.outputs:
            await self._send_one(out)
        for record, error in plan.letters:
            await self.dead_letters.letter(record, error)
        await self.dead_letters.write_batch(plan.partition)
        self.book.add(plan, self.tables, self._deliveries, batch)
        self._deliveries = []
        self._bound_cache(plan)
        self.folded_to[plan.partition] = plan.span[1] - 1

    def _bound_cache(self, plan: BatchPlan) -> None:
        """At most :data:`STATE_CACHE_MAX` decoded states beyond those newer than their
        table record (the tables hold all but these)."""
        if len(self.states) > STATE_CACHE_MAX:
            keep = self.book.unwritten() | plan.states.keys()
            kept = {sid: self.states[sid] for sid in keep if sid in self.states}
            self.states.clear()
            self.states.update(kept)

    async def _send_one(self, out: OutRecord) -> None:
        """An output of the batch (or a dead letter without a sink: the unit tests); its
        delivery is awaited before the batch's state is written."""
        delivery = await self.send(out)
        if inspect.isawaitable(delivery):
            self._deliveries.append(delivery)

    def _drop_sessions(self, session_ids: Iterable[str]) -> None:
        """Forget what the folds cached of these sessions: they continue from their table
        records, or from what a persist holds for them and has not written yet."""
        self.folded_to.clear()   # no longer vouched for: the committed offsets still are
        for session_id in session_ids:
            self.states.pop(session_id, None)
            self.tables.chunks.pop(session_id, None)
            record, cursor = self.book.taken(session_id)
            if record is not None:
                self.states[session_id] = SessionState.from_json(session_id, record)
                cursor = max(int(record["next"]), cursor or 0)
            if cursor is not None:
                self.tables.chunks[session_id] = cursor
