"""Session-topic records -> table updates and published changes, one fetched batch at a time.

The decisions are core's pure folds (:mod:`pipeline.core.projection`, ``usage``, ``fleet``);
this module only moves their state in and out of the tables and sends what they return.
Tables are plain ``MutableMapping`` values here (faust tables in the worker, dicts in unit
tests); sending goes through one ``Send`` callable (faust's producer in the worker). The
worker hands over everything one fetch returned for a partition (see :mod:`.transport`);
:meth:`SessionFolder.handle` is the same for a single record.

Delivery rules (DESIGN.md section 2): a seq below the next expected one is a duplicate
(skipped, counted); a seq above it is a gap (counted, logged, dead-lettered with the reason,
never folded past); an ``assistant/chunk`` is recognised by its ``dsh.type`` header and only
advances the session's cursor, without being decoded; a record that does not decode, or an
event that breaks a surface rule, is dead-lettered and processing goes on.

**Crash consistency.** Table writes reach their changelogs in the order they were made, a
kill -9 loses a suffix of them, and faust commits a batch's offsets only after the batch was
processed and the producer flushed. Everything a batch decides for one session (next seq,
surface slots, usage, fleet status) is ONE record of the ``sessions`` table, written once at
the end of the batch: after a crash it holds all of the session's events of that batch or
none, and redelivery from the committed offset skips what it holds and applies the rest once.
``nodes`` (the projected message of each surface event) is written before that record and is
idempotent. Outputs are sent before the state is written, so a crash can only repeat them
(same key and value on the compacted topics; the per-model stage drops a repeated sample by
seq). Fleet status and session usage are published once per session per batch (their last
value: the topics are compacted); derived-message changes one record per change. Output
values are Avro (:mod:`pipeline.codec.outputs`); usage samples to the internal per-model
topic stay JSON.

**Chunks and gaps after a kill -9.** Chunks (about 80% of the records) change no table but
move the session's cursor. At the end of every batch the cursor of each session it moved is
persisted: in the ``sessions`` record when that is written anyway, else in the small
``chunk_marks`` table (one write per session per batch, not per chunk). So at every committed
offset the tables know exactly which seq each session expects next, and the first record
redelivered after a restart is judged against that: a missing seq is a gap whether or not a
restart fell next to it. (The alternative, accepting a jump over the chunk seqs that the next
``assistant/message`` lists in ``sourceEventSeqs``, would report false gaps: the chunks of a
failed provider attempt, or of a stream cut by a crash and closed by crash repair, are listed
by no message.) Cursors are also cached in memory (``SessionTables.chunks``) together with
the decoded states, both dropped on every rebalance: the tables stay the truth.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pipeline.adapters.kafka.dlq import dead_letter
from pipeline.adapters.kafka.records import (
    ConsumedRecord,
    Headers,
    InboxRecord,
    OutRecord,
    headers_of,
)
from pipeline.codec.outputs import OutputCodecs, default_output_codecs
from pipeline.codec.records import HEADER_SEQ, HEADER_TYPE, session_id_of_key
from pipeline.core.dedup import Delivery
from pipeline.core.errors import CodecError, EventError, SequenceError
from pipeline.core.events import SURFACE_TYPES, Event, JsonValue, dumps_json
from pipeline.core.fleet import FleetStatus
from pipeline.core.projection import MessageChange, SurfaceSlots, with_session
from pipeline.core.usage import SessionUsage, UsageSample, session_record
from pipeline.core.validation import projected_message
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.settings import TopicNames

log = logging.getLogger(__name__)

CHUNK: Final = "assistant/chunk"
_CHUNK_TYPE: Final = CHUNK.encode()
USAGE_TYPES: Final = frozenset({"assistant/message", "request/header"})
STATE_CACHE_MAX: Final = 50_000  # decoded session states kept between batches

Decoder = Callable[[bytes], tuple[str, Event]]
Table = MutableMapping[str, Any]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A record to send; ``value`` None is a tombstone (compaction drops the key)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    partition: int | None = None

    @classmethod
    def of(cls, record: OutRecord) -> Outgoing:
        return cls(record.topic, record.key, record.value, record.headers, record.partition)


# Returns, when the sender has one, the record's delivery (awaitable until the broker
# acknowledged it): see *Outputs before state* in SessionFolder.
Send = Callable[[Outgoing], Awaitable[object]]


class DerivedRoute(Protocol):
    """Which version of the derived messages a record's changes go to (a
    :class:`.projection_follow.ProjectionFollow` in the worker); None: publish nothing."""

    async def gate(self, partition: int, offset: int) -> str | None: ...
    def topic_for(self, partition: int, offset: int) -> str | None: ...


@dataclass(frozen=True, slots=True)
class SessionTables:
    """Co-partitioned tables (``sessions`` and ``chunk_marks`` by session, ``nodes`` by
    ``<session>/<seq>``) and the in-memory cursors (cleared on every rebalance)."""

    sessions: Table
    nodes: Table
    chunk_marks: Table
    chunks: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class SessionState:
    """Everything the folds of one session need: the value of the ``sessions`` table."""

    session_id: str
    next_seq: int = 0
    partition: int = -1
    surface: SurfaceSlots = field(default_factory=SurfaceSlots)
    usage: SessionUsage = field(default_factory=SessionUsage)
    fleet: FleetStatus | None = None
    stalled: bool = False  # a gap or an invalid event was reported and not yet filled

    def to_json(self) -> dict[str, JsonValue]:
        """A fresh value: faust serialises table values later, so nothing may be shared
        with this (cached, still changing) state."""
        fleet = self.fleet or FleetStatus(self.session_id)
        surface = {"nodes": [node[:] for node in self.surface.nodes],
                   "ops": [op[:] for op in self.surface.ops]}
        return {"next": self.next_seq, "partition": self.partition, "surface": surface,
                "usage": self.usage.to_json(), "fleet": fleet.to_json(),
                "stalled": self.stalled}

    @classmethod
    def from_json(cls, session_id: str, raw: JsonValue) -> SessionState:
        if raw is None:
            return cls(session_id, fleet=FleetStatus(session_id))
        return cls(session_id, int(raw["next"]), int(raw["partition"]),
                   SurfaceSlots.from_json(raw["surface"]), SessionUsage.from_json(raw["usage"]),
                   FleetStatus.from_json(raw["fleet"]), bool(raw.get("stalled", False)))


def classify(expected: int, seq: int) -> Delivery:
    if seq < expected:
        return Delivery.DUPLICATE
    return Delivery.GAP if seq > expected else Delivery.APPLY


def json_bytes(value: Any) -> bytes | None:
    return None if value is None else dumps_json(value).encode("utf-8")


def next_expected(tables: SessionTables, session_id: str) -> int:
    """The seq the session's next record must carry (0 for an unknown session)."""
    state = tables.sessions.get(session_id)
    return max(int(state["next"]) if state else 0, int(tables.chunk_marks.get(session_id) or 0),
               tables.chunks.get(session_id, 0))


def chunk_seq(headers: Iterable[tuple[str, bytes | None]] | None) -> int | None:
    """The seq of a chunk record from its headers; None for any other or unreadable record.

    The hot path of the worker (most records are chunks), hence no general header parsing:
    as in :func:`pipeline.codec.records.read_headers` the last header of a name wins, and a
    record whose headers are malformed is left to decoding, which decides (and dead-letters).
    """
    type_ = seq = None
    for name, value in headers or ():
        if name == HEADER_TYPE:
            type_ = value
        elif name == HEADER_SEQ:
            seq = value
    if type_ != _CHUNK_TYPE or seq is None or len(seq) > 20 or not seq.isdigit():
        return None
    return int(seq)


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
                 outputs: OutputCodecs | None = None) -> None:
        self.tables = tables
        # Avro encoders of the output topics (single-object encoding unless given ones
        # with registry ids); the internal usage-by-model topic stays JSON.
        self.outputs = outputs or default_output_codecs()
        self.route = route  # None: always the derived-messages topic of ``topics``
        self.send = send
        self.decode = decode
        self.topics = topics
        self.usage_topic = usage_topic
        self.counters = counters
        self.states: dict[str, SessionState] = {}  # decoded table values, see forget()
        self.deliveries: list[Awaitable[object]] = []  # this batch's unacknowledged outputs

    def forget(self) -> None:
        """Drop what is cached in memory (partitions moved: others folded meanwhile)."""
        self.tables.chunks.clear()
        self.states.clear()
        self.deliveries.clear()

    async def handle(self, record: ConsumedRecord) -> None:
        await self.handle_batch((record,))

    async def handle_batch(self, records: Sequence[ConsumedRecord]) -> None:
        """Fold records of one partition, in order; tables are written at the end. With a
        route, its gate is passed once per batch (it waits while a handover is pending)."""
        if self.route is not None and records:
            await self.route.gate(records[0].partition, records[0].offset)
        batch = _Batch()
        try:
            for record in records:
                self.counters.records += 1
                seq = chunk_seq(record.headers)
                session_id = _session_of(record.key) if seq is not None else None
                if seq is not None and session_id is not None:
                    await self._chunk(batch, record, session_id, seq)
                else:
                    await self._event(batch, record)
            await self._flush(batch)
        except BaseException:
            self.forget()  # the cache may hold changes the tables never got
            raise

    def _cursor(self, batch: _Batch, session_id: str) -> int:
        """The seq the session expects next. Kept in the batch until its end, so that what
        the HTTP views read (tables + ``tables.chunks``) never runs ahead of the tables."""
        cursor = batch.cursors.get(session_id)
        if cursor is None:
            cursor = self.tables.chunks.get(session_id)
            if cursor is None:
                cursor = next_expected(self.tables, session_id)
            batch.cursors[session_id] = batch.started[session_id] = cursor
        return cursor

    def _admit(self, batch: _Batch, session_id: str, seq: int) -> Delivery:
        verdict = classify(self._cursor(batch, session_id), seq)
        if verdict is Delivery.DUPLICATE:
            self.counters.duplicates += 1
        return verdict

    async def _chunk(self, batch: _Batch, record: ConsumedRecord, session_id: str,
                     seq: int) -> None:
        verdict = self._admit(batch, session_id, seq)
        if verdict is Delivery.GAP:
            await self._report_gap(batch, record, session_id, seq, CHUNK)
        elif verdict is Delivery.APPLY:
            batch.cursors[session_id] = seq + 1
            self.counters.chunks_skipped_undecoded += 1

    async def _event(self, batch: _Batch, record: ConsumedRecord) -> None:
        try:
            session_id, event = self.decode(record.value or b"")
        except CodecError as exc:
            await self._dead_letter(record, exc)
            return
        verdict = self._admit(batch, session_id, event.seq)
        if verdict is Delivery.GAP:
            await self._report_gap(batch, record, session_id, event.seq, event.type)
        elif verdict is Delivery.APPLY and await self._apply(batch, record, session_id, event):
            batch.cursors[session_id] = event.seq + 1

    def _state(self, batch: _Batch, session_id: str) -> SessionState:
        state = batch.states.get(session_id) or self.states.get(session_id)
        if state is None:
            state = SessionState.from_json(session_id, self.tables.sessions.get(session_id))
            if len(self.states) >= STATE_CACHE_MAX:
                self.states.clear()
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
        self.counters.dead_letters += 1
        if not isinstance(error, SequenceError):
            log.warning("dead letter from %s[%d]@%d: %s: %s", record.topic, record.partition,
                        record.offset, type(error).__name__, error)
        await self._send(Outgoing.of(dead_letter(_inbox_record(record), error)))

    async def _apply(self, batch: _Batch, record: ConsumedRecord, session_id: str,
                     event: Event) -> bool:
        """Fold ``event``; False when it breaks a rule (dead-lettered, nothing changed)."""
        state = self._state(batch, session_id)
        try:
            plan = _plan(state, event)
        except EventError as exc:
            # The fold cannot go on correctly: the session stops here (later seqs are gaps).
            self.counters.invalid_events += 1
            self._stall(batch, session_id, record.partition)
            await self._dead_letter(record, exc)
            return False
        await self._publish(session_id, plan, record)
        if plan.changes:
            self.tables.nodes[f"{session_id}/{event.seq}"] = {"slot": plan.changes[0].slot,
                                                              "message": plan.message}
        state.next_seq, state.partition, state.stalled = event.seq + 1, record.partition, False
        batch.dirty.add(session_id)
        if plan.sample is not None:
            batch.usage.add(session_id)
        if plan.fleet_changed:
            batch.fleet.add(session_id)
        self.counters.applied += 1
        self.counters.steps_started += event.type == "step/start"
        return True

    async def _publish(self, session_id: str, plan: FoldPlan, record: ConsumedRecord) -> None:
        """What must be sent per event: each message change (to the version the route
        names) and each usage sample."""
        if plan.changes:
            topic: str | None = self.topics.derived_messages
            if self.route is not None:
                topic = self.route.topic_for(record.partition, record.offset)
            if topic is not None:
                encode = self.outputs.derived.encode_change
                for change in plan.changes:
                    await self._send(Outgoing(topic, change.key.encode(), encode(change)))
                self.counters.derived_changes += len(plan.changes)
        if plan.sample is not None:
            self.counters.usage_samples += 1
            await self._send(Outgoing(self.usage_topic, plan.sample.model_key.encode(),
                                     json_bytes(plan.sample.to_json())))

    async def _send(self, out: Outgoing) -> None:
        delivery = await self.send(out)
        if inspect.isawaitable(delivery):
            self.deliveries.append(delivery)

    async def _settle(self) -> None:
        """Wait until the broker acknowledged every output of the batch (raises if one
        failed: the batch fails and is never committed)."""
        deliveries, self.deliveries = self.deliveries, []
        if deliveries:
            await asyncio.gather(*deliveries)

    async def _flush(self, batch: _Batch) -> None:
        """Publish the batch's last fleet/usage values, then write each session's state.

        *Outputs before state.* A session's state record says which seqs its outputs were
        sent for; after a kill -9 the changelog may hold it while an output written before
        it, on another partition, never reached the broker (the producer sends partitions'
        batches independently): that output would be lost for good (a usage sample missing
        from the model totals, a change missing from the derived topic). So the state is
        written only once every output of the batch is acknowledged."""
        for session_id in sorted(batch.fleet):
            fleet = batch.states[session_id].fleet
            if fleet is not None:
                await self._send(Outgoing(self.topics.fleet, session_id.encode(),
                                         self.outputs.fleet.encode(fleet.to_json())))
        for session_id in sorted(batch.usage):
            totals = batch.states[session_id].usage.totals
            await self._send(Outgoing(self.topics.usage, f"session/{session_id}".encode(),
                                     self.outputs.usage.encode(session_record(session_id,
                                                                              totals))))
        await self._settle()
        for session_id, started in batch.started.items():
            cursor = batch.cursors[session_id]
            if session_id in batch.dirty:
                state = batch.states[session_id]
                state.next_seq = max(state.next_seq, cursor)
                self.tables.sessions[session_id] = state.to_json()  # the one atomic write
            elif cursor > started:
                self.tables.chunk_marks[session_id] = cursor
        self.tables.chunks.update(batch.cursors)


@dataclass(slots=True)
class FoldPlan:
    """What one event changed (the state itself is updated in place)."""

    message: Any = None
    changes: list[MessageChange] = field(default_factory=list)
    sample: UsageSample | None = None
    fleet_changed: bool = False


def _plan(state: SessionState, event: Event) -> FoldPlan:
    """Fold ``event`` into ``state``; raises EventError having changed nothing."""
    plan = FoldPlan()
    totals, last_model = state.usage.totals, state.usage.last_model
    try:
        if event.type in USAGE_TYPES:
            plan.sample = state.usage.apply(state.session_id, event)
        if event.type in SURFACE_TYPES and event.surface_op is not None:
            plan.message = projected_message(event)
            # apply() refuses a bad replace before it changes the surface
            plan.changes = with_session(state.surface.apply(event, plan.message),
                                        state.session_id)
    except EventError:
        state.usage.totals, state.usage.last_model = totals, last_model
        raise
    fleet = state.fleet or FleetStatus(state.session_id)
    plan.fleet_changed = fleet.apply(event)
    state.fleet = fleet
    return plan


def _session_of(key: bytes | None) -> str | None:
    try:
        return session_id_of_key(key)
    except CodecError:
        return None  # decoding decides (and dead-letters)


def _inbox_record(record: ConsumedRecord) -> InboxRecord:
    if isinstance(record, InboxRecord):
        return record
    return InboxRecord(record.topic, record.partition, record.offset, record.key,
                       record.value, headers_of(record.headers))
