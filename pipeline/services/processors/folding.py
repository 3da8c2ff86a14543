"""Session-topic records -> published changes and table updates, one fetched batch at a time.

The decisions are core's pure folds (:mod:`pipeline.core.projection`, ``usage``, ``fleet``);
this module only moves their state in and out of the tables and sends what they return.
Tables are plain ``MutableMapping`` values here (faust tables in the worker, dicts in unit
tests); sending goes through one ``Send`` callable (faust's producer in the worker). The
worker hands over everything one fetch returned for a partition (see
:mod:`pipeline.adapters.faust.transport`);
:meth:`SessionFolder.handle` is the same for a single record.

Delivery rules (DESIGN.md section 2): a seq below the next expected one is a duplicate
(skipped, counted). A seq above it means the worker's state is behind the log, and **the
log is right**: the worker reads the session's missing records back from the session topic
(``read_back``, a search back bounded by the session's own span) and folds them, with a
metric and a log line naming the session (:meth:`SessionFolder._heal`). Only a gap the log
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

import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pipeline.adapters.kafka.dlq import MAX_RECORD_BYTES
from pipeline.adapters.kafka.records import (
    Headers,
    OutRecord,
)
from pipeline.adapters.kafka.session_span import record_seq
from pipeline.codec.outputs import OutputCodecs, default_output_codecs
from pipeline.codec.records import (
    ConsumedRecord,
    session_first_header,
    source_headers,
)
from pipeline.core.dedup import Delivery
from pipeline.core.errors import BrokerError, CodecError, EventError, SequenceError
from pipeline.core.events import Event
from pipeline.core.usage import session_record
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.dead_letters import (
    DeadLetterBook,
    DeadLettered,
    DeadLetterSink,
)
from pipeline.services.processors.persisting import BatchDone, ChangeBook
from pipeline.services.processors.records import (
    CHUNK,
    chunk_seq,
    classify,
    json_bytes,
    session_of,
)
from pipeline.services.processors.session_state import (
    FoldPlan,
    SessionState,
    SessionTables,
    next_expected,
    plan_event,
    refuse_oversize,
)
from pipeline.settings import TopicNames

log = logging.getLogger(__name__)

STATE_CACHE_MAX: Final = 50_000  # decoded session states kept (beyond the unpersisted ones)

Decoder = Callable[[bytes], tuple[str, Event]]


# Returns, when the sender has one, the record's delivery (awaitable until the broker
# acknowledged it): see *Outputs before state* in SessionFolder.
Send = Callable[[OutRecord], Awaitable[object]]


# (partition, session, first seq wanted, below offset) -> the session's records from that
# seq on below that offset, one per seq in seq order (the heal's read of the log:
# :func:`pipeline.adapters.kafka.session_span.session_records_before` in the worker).
ReadBack = Callable[[int, str, int, int], Awaitable[Sequence[ConsumedRecord]]]


class DerivedRoute(Protocol):
    """Which version of the derived messages a record's changes go to (a
    :class:`.projection_follow.ProjectionFollow` in the worker); None: publish nothing."""

    async def gate(self, partition: int, offset: int) -> str | None: ...
    def topic_for(self, partition: int, offset: int) -> str | None: ...
    # The partition of a change of an event in ``partition`` of the session topic, in the
    # version topic_for named (both read the active version in one synchronous step).
    def partition_of(self, partition: int) -> int | None: ...


@dataclass(slots=True)
class _Batch:
    """What one batch changed, flushed to tables and outputs at its end."""

    started: dict[str, int] = field(default_factory=dict)   # cursor before the batch
    cursors: dict[str, int] = field(default_factory=dict)   # cursor now
    states: dict[str, SessionState] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)            # sessions record to write
    fleet: set[str] = field(default_factory=set)            # fleet status to publish
    usage: set[str] = field(default_factory=set)            # session usage to publish


class SessionFolder:
    """Folds session-topic records into the session tables."""

    def __init__(self, tables: SessionTables, send: Send, decode: Decoder, topics: TopicNames,
                 usage_topic: str, counters: DeliveryCounters,
                 route: DerivedRoute | None = None, *,
                 outputs: OutputCodecs | None = None,
                 max_record_bytes: int = MAX_RECORD_BYTES,
                 dead_lettered: DeadLettered | None = None,
                 read_back: ReadBack | None = None,
                 dead_letter_sink: DeadLetterSink | None = None) -> None:
        self.tables = tables
        self.read_back = read_back   # the heal's reader of the log (None: gaps reported)
        self.healing = False
        # Avro encoders of the output topics (single-object encoding unless given ones
        # with registry ids); the internal usage-by-model topic stays JSON.
        self.outputs = outputs or default_output_codecs()
        self.route = route  # None: always the derived-messages topic of ``topics``
        self._max_record_bytes = max_record_bytes
        self.send = send
        self.decode = decode
        self.topics = topics
        self.usage_topic = usage_topic
        self.counters = counters
        self.states: dict[str, SessionState] = {}  # decoded, as folded so far; see forget()
        # partition -> the last offset of its last batch folded whole: every record up to
        # it is in ``states`` or the tables (dropped with any cached state given up).
        self.folded_to: dict[int, int] = {}
        self.deliveries: list[Awaitable[object]] = []  # this batch's unacknowledged outputs
        self.book = ChangeBook(counters, self._drop_sessions)
        self.dead_letters = DeadLetterBook(dead_lettered, dead_letter_sink,
                                           send=self._send, counters=counters,
                                           max_record_bytes=max_record_bytes)

    @property
    def max_record_bytes(self) -> int:
        """The producer's record limit: no table record, output or dead letter above it."""
        return self._max_record_bytes

    @max_record_bytes.setter
    def max_record_bytes(self, limit: int) -> None:
        self._max_record_bytes = self.dead_letters.max_record_bytes = limit

    async def persist(self) -> None:
        """Write what the folds changed to the tables (see :mod:`.persisting`)."""
        await self.book.persist(self.tables)

    async def forget(self) -> None:
        """Drop what is cached in memory and not persisted (partitions moved: others fold
        them from the committed offset)."""
        async with self.book.lock:
            dropped = self.book.give_up_all()
            self.tables.chunks.clear()
            self.states.clear()
            self.folded_to.clear()
            self.deliveries.clear()
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

    async def handle_batch(self, records: Sequence[ConsumedRecord],
                           done: BatchDone | None = None) -> None:
        """Fold records of one partition, in order. What they change is written to the
        tables by the next :meth:`persist`, which calls ``done`` then. With a route, its
        gate is passed once per batch (it waits while a handover is pending)."""
        if not records:
            return
        first = records[0]
        self.dead_letters.folding(first.partition, first.offset)
        if self.route is not None:
            await self.route.gate(first.partition, first.offset)
        async with self.book.lock:
            batch = _Batch()
            try:
                for record in records:
                    self.counters.records += 1
                    await self._fold_record(batch, record)
                await self._publish_last_values(
                    batch, source_headers(first.partition, records[-1].offset))
                await self.dead_letters.write_batch(first.partition)
                self._finish(batch, first.partition, done)
                self.folded_to[first.partition] = records[-1].offset
            except BaseException:
                # The cached states of the partition may hold changes half made: the
                # partition's unpersisted batches are given up with this one.
                self.deliveries = []
                self.dead_letters.drop_batch()
                self._drop_sessions(self.book.give_up_partition(first.partition)
                                    | set(batch.started))
                raise

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

    def _cursor(self, batch: _Batch, session_id: str) -> int:
        """The seq the session expects next (moved in the batch, into ``tables.chunks``
        at its end)."""
        cursor = batch.cursors.get(session_id)
        if cursor is None:
            cursor = self.tables.chunks.get(session_id)
            if cursor is None:
                cursor = next_expected(self.tables, session_id)
            batch.cursors[session_id] = batch.started[session_id] = cursor
        return cursor

    async def _fold_record(self, batch: _Batch, record: ConsumedRecord) -> None:
        seq = chunk_seq(record.headers)
        session_id = session_of(record.key) if seq is not None else None
        if seq is not None and session_id is not None:
            await self._chunk(batch, record, session_id, seq)
        else:
            await self._event(batch, record)

    async def _admit(self, batch: _Batch, record: ConsumedRecord, session_id: str, seq: int,
                     type_: str) -> Delivery:
        """Whether to apply the record: a gap is healed from the log when it can be
        (:meth:`_heal`), else reported."""
        verdict = classify(self._cursor(batch, session_id), seq)
        if verdict is Delivery.DUPLICATE:
            self.counters.duplicates += 1
        elif verdict is Delivery.GAP:
            if await self._heal(batch, record, session_id, seq):
                return Delivery.APPLY
            await self._report_gap(batch, record, session_id, seq, type_)
        return verdict

    async def _chunk(self, batch: _Batch, record: ConsumedRecord, session_id: str,
                     seq: int) -> None:
        if await self._admit(batch, record, session_id, seq, CHUNK) is Delivery.APPLY:
            batch.cursors[session_id] = seq + 1
            self.counters.chunks_skipped_undecoded += 1

    async def _event(self, batch: _Batch, record: ConsumedRecord) -> None:
        try:
            session_id, event = self.decode(record.value or b"")
        except CodecError as exc:
            await self._dead_letter(record, exc)
            return
        verdict = await self._admit(batch, record, session_id, event.seq, event.type)
        if verdict is Delivery.APPLY and await self._apply(batch, record, session_id, event):
            batch.cursors[session_id] = event.seq + 1

    async def _heal(self, batch: _Batch, record: ConsumedRecord, session_id: str,
                    seq: int) -> bool:
        """The session's state is behind its log (a gap on a valid log, or an unknown
        session whose first record is not seq 0): the log is right. Reads the missing
        records back (``read_back``) and folds them; True when the session now expects
        ``seq``. Not for a session stopped at an invalid event or a real gap (its later
        seqs are gaps of the log's own), nor while healing (no nesting). A read that fails
        raises: the batch is folded again, nothing is dead-lettered for it."""
        if self.read_back is None or self.healing or self._state(batch, session_id).stalled:
            return False
        expected = self._cursor(batch, session_id)
        earlier = await self.read_back(record.partition, session_id, expected, record.offset)
        self.healing = True
        try:
            for found in earlier:
                cursor = self._cursor(batch, session_id)
                if cursor >= seq or record_seq(found) != cursor:
                    break   # done, or a hole in the log below the record
                await self._fold_record(batch, found)
                if self._cursor(batch, session_id) == cursor:
                    break   # refused by the fold (the log's own fault, handled back then)
        finally:
            self.healing = False
        healed = self._cursor(batch, session_id) == seq
        self.counters.sessions_healed += healed
        self.counters.records_healed += self._cursor(batch, session_id) - expected
        log.warning("session %s: the worker expected seq %d at %s[%d] offset %d, found %d: "
                    "%s %d records read back from the log", session_id, expected, record.topic,
                    record.partition, record.offset, seq,
                    "rebuilt from" if healed else "NOT healed (a hole in the log) after",
                    self._cursor(batch, session_id) - expected)
        return healed

    def _state(self, batch: _Batch, session_id: str) -> SessionState:
        state = batch.states.get(session_id) or self.states.get(session_id)
        if state is None:
            state = SessionState.from_json(session_id, self.tables.sessions.get(session_id))
            if len(self.states) >= STATE_CACHE_MAX:   # the tables hold all but these
                keep = self.book.unwritten() | batch.states.keys()
                self.states = {sid: self.states[sid] for sid in keep if sid in self.states}
            self.states[session_id] = state
        batch.states[session_id] = state
        return state

    def _stall(self, batch: _Batch, session_id: str, partition: int) -> None:
        """Remember (in the table) that the session stopped at a gap or an invalid event."""
        state = self._state(batch, session_id)
        if not state.stalled:
            state.stalled, state.partition = True, partition
            batch.dirty.add(session_id)

    async def _report_gap(self, batch: _Batch, record: ConsumedRecord, session_id: str,
                          seq: int, type_: str) -> None:
        expected = self._cursor(batch, session_id)
        self._stall(batch, session_id, record.partition)
        self.counters.gaps += 1
        error = SequenceError(expected=expected, found=seq, type=type_)
        log.warning("session %s: gap at partition %d offset %d: %s; not folded past",
                    session_id, record.partition, record.offset, error)
        await self._dead_letter(record, error)

    async def _dead_letter(self, record: ConsumedRecord, error: Exception) -> None:
        if not self.healing:   # read back below the committed offset: handled back then
            await self.dead_letters.letter(record, error)

    async def _apply(self, batch: _Batch, record: ConsumedRecord, session_id: str,
                     event: Event) -> bool:
        """Fold ``event``; False when it breaks a rule (dead-lettered, nothing changed)."""
        state = self._state(batch, session_id)
        try:
            refuse_oversize(state, event, len(record.value or b""), self.max_record_bytes)
            plan = plan_event(state, event)
        except EventError as exc:
            # The fold cannot go on correctly: the session stops here (later seqs are gaps).
            self.counters.invalid_events += 1
            self._stall(batch, session_id, record.partition)
            await self._dead_letter(record, exc)
            return False
        outgoing = self._outputs(session_id, event.seq, plan, record)   # may refuse
        # All of the state first, then the awaits: views read between them.
        if plan.changes:   # the nodes table holds the live surface's messages only
            for seq in plan.removed:
                self.book.set_node(record.partition, f"{session_id}/{seq}", None, self.tables)
            self.book.set_node(record.partition, f"{session_id}/{event.seq}",
                               {"slot": plan.changes[0].slot, "message": plan.message},
                               self.tables)
        if event.seq == 0:
            state.first_offset = record.offset
        state.next_seq, state.partition, state.stalled = event.seq + 1, record.partition, False
        batch.dirty.add(session_id)
        if plan.sample is not None:
            batch.usage.add(session_id)
        if plan.fleet_changed:
            batch.fleet.add(session_id)
        self.counters.applied += 1
        self.counters.steps_started += event.type == "step/start"
        for out in outgoing:
            await self._send(out)
        return True

    def _outputs(self, session_id: str, seq: int, plan: FoldPlan, record: ConsumedRecord
                 ) -> list[OutRecord]:
        """What must be sent for one event: each message change (to the version the route
        names) and the usage sample.

        Raises :class:`BrokerError` for a change above the producer's record limit, before
        anything is written: the ``nodes`` record of the message is as large, and a table
        write the producer refuses stops every later table write of the worker (faust's
        producer buffer dies with it)."""
        found = []
        if plan.changes:
            encode = self.outputs.derived.encode_change
            values = [(change.key.encode(), encode(change)) for change in plan.changes]
            largest = max(len(value or b"") for _, value in values)
            if largest > self.max_record_bytes:
                raise BrokerError(f"session {session_id} seq {seq}: its derived change is "
                                  f"{largest:,} bytes, above the {self.max_record_bytes:,}-"
                                  f"byte record limit of the producer; not folded")
            topic: str | None = self.topics.derived_messages
            partition: int | None = None
            if self.route is not None:
                topic = self.route.topic_for(record.partition, record.offset)
                partition = self.route.partition_of(record.partition)
            if topic is not None:
                source = source_headers(record.partition, record.offset)
                found += [OutRecord(topic, key, value, source, partition)
                          for key, value in values]
                self.counters.derived_changes += len(values)
        if plan.sample is not None:
            self.counters.usage_samples += 1
            found.append(OutRecord(self.usage_topic, plan.sample.model_key.encode(),
                                  json_bytes(plan.sample.to_json())))
        return found

    async def _send(self, out: OutRecord) -> None:
        delivery = await self.send(out)
        if inspect.isawaitable(delivery):
            self.deliveries.append(delivery)

    async def _publish_last_values(self, batch: _Batch, source: Headers) -> None:
        """The batch's last fleet status and usage totals of each session it changed, with
        the batch's last offset as their source position (readers: ``source_position``); a
        fleet record also names where the session's first event lies (``export``, ``tail``
        start there: :func:`~pipeline.codec.records.session_first_offset`)."""
        for session_id in sorted(batch.fleet):
            state = batch.states[session_id]
            if state.fleet is not None:
                headers = (*source, session_first_header(state.first_offset))
                await self._send(OutRecord(self.topics.fleet, session_id.encode(),
                                           self.outputs.fleet.encode(state.fleet.to_json()),
                                           headers))
        for session_id in sorted(batch.usage):
            totals = batch.states[session_id].usage.totals
            await self._send(OutRecord(self.topics.usage, f"session/{session_id}".encode(),
                                     self.outputs.usage.encode(session_record(session_id,
                                                                              totals)),
                                     source))

    def _finish(self, batch: _Batch, partition: int, done: BatchDone | None) -> None:
        """The batch's changes join its partition's unpersisted ones: per session its state
        (the one record to write) or, when only chunks moved it, its cursor."""
        changes = self.book.of(partition)
        for session_id, started in batch.started.items():
            cursor = batch.cursors[session_id]
            state = (batch.states[session_id] if session_id in batch.dirty
                     else changes.states.get(session_id))
            if state is not None:
                state.next_seq = max(state.next_seq, cursor)
                changes.states[session_id] = state
                changes.marks.pop(session_id, None)
            elif cursor > started:
                changes.marks[session_id] = cursor
        self.tables.chunks.update(batch.cursors)
        changes.deliveries += self.deliveries
        self.deliveries = []
        changes.batches.append(done or _nothing)
        # faust's tables take a write's partition from the current event (a batch's)
        changes.context = contextvars.copy_context()


def _nothing() -> None:
    """The "folded" mark of a batch nobody waits for (unit tests, a record alone)."""
