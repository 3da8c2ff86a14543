"""One session-topic record -> table updates and published changes.

The decisions are core's pure folds (:mod:`pipeline.core.projection`, ``usage``, ``fleet``);
this module only moves their state in and out of the tables and sends what they return.
Tables are plain ``MutableMapping`` values here (faust tables in the worker, dicts in unit
tests); sending goes through one ``Send`` callable (faust's producer in the worker).

Delivery rules (DESIGN.md section 2): a seq below the next expected one is a duplicate
(skipped, counted); a seq above it is a gap (counted, logged, dead-lettered with the reason,
never folded past); an ``assistant/chunk`` is recognised by its ``dsh.type`` header and only
advances the session's chunk cursor, without being decoded; a record that does not decode, or
an event that breaks a surface rule, is dead-lettered and processing goes on.

**Crash consistency.** Table writes reach their changelogs in the order they were made, and a
kill -9 loses a suffix of them; offsets are committed only after every earlier write is
durable. So everything one event decides (next seq, surface slots, usage, fleet status) is
ONE record of the ``sessions`` table: after a crash it either holds the event or not, and
redelivery either skips it as a duplicate or applies it once. ``nodes`` (the projected message
of each surface event) is written before that record and is idempotent. Outputs are sent
before the state is written, so a crash can only repeat them (same key and value on the
compacted topics; the per-model stage drops a repeated usage sample by seq).

**Chunks** (about 80% of the records) change no table, so their cursor lives in memory; a
changelog write per chunk would cost more than everything else together. Every
``CHUNK_MARK_EVERY`` chunks of a session the cursor is checkpointed in the small ``chunk_marks``
table. After a start or a rebalance the in-memory cursors are empty, and redelivery starts at
the committed offset, possibly mid chunk-run: the first record of a session then
re-synchronises the cursor when it is at most ``CHUNK_MARK_EVERY`` seqs past what the tables
know (only unpersisted chunks can lie there); further ahead it is a gap as usual. So a gap of
fewer than that many seqs falling exactly on a restart boundary is the one case not reported.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.adapters.kafka.dlq import dead_letter
from pipeline.adapters.kafka.records import Headers, InboxRecord, OutRecord
from pipeline.codec.records import header_type_and_seq, session_id_of_key
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
CHUNK_MARK_EVERY: Final = 32
USAGE_TYPES: Final = frozenset({"assistant/message", "request/header"})

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


Send = Callable[[Outgoing], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class SessionTables:
    """Co-partitioned tables (``sessions`` and ``chunk_marks`` by session, ``nodes`` by
    ``<session>/<seq>``) and the in-memory chunk cursors (cleared on every rebalance)."""

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
    stalled: bool = False  # a gap or an invalid event was reported: no resync past it

    def to_json(self) -> dict[str, JsonValue]:
        fleet = self.fleet or FleetStatus(self.session_id)
        return {"next": self.next_seq, "partition": self.partition,
                "surface": self.surface.to_json(), "usage": self.usage.to_json(),
                "fleet": fleet.to_json(), "stalled": self.stalled}

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


class SessionFolder:
    """Folds session-topic records into the session tables."""

    def __init__(self, tables: SessionTables, send: Send, decode: Decoder, topics: TopicNames,
                 usage_topic: str, counters: DeliveryCounters) -> None:
        self.tables = tables
        self.send = send
        self.decode = decode
        self.topics = topics
        self.usage_topic = usage_topic
        self.counters = counters

    async def handle(self, record: InboxRecord) -> None:
        self.counters.records += 1
        if await self._skip_chunk(record):
            return
        try:
            session_id, event = self.decode(record.value or b"")
        except CodecError as exc:
            await self._dead_letter(record, exc)
            return
        verdict = self._admit(session_id, event.seq)
        if verdict is Delivery.GAP:
            await self._report_gap(record, session_id, event.seq, event.type)
        elif verdict is Delivery.APPLY and await self._apply(record, session_id, event):
            self.tables.chunks[session_id] = max(self.tables.chunks.get(session_id, 0),
                                                 event.seq + 1)

    async def _skip_chunk(self, record: InboxRecord) -> bool:
        """A chunk with readable type+seq headers: advance the chunk cursor, never decode."""
        try:
            type_, seq = header_type_and_seq(record.headers)
            session_id = session_id_of_key(record.key)
        except CodecError:
            return False  # malformed headers or key: decoding decides (and dead-letters)
        if type_ != CHUNK or seq is None:
            return False
        verdict = self._admit(session_id, seq)
        if verdict is Delivery.GAP:
            await self._report_gap(record, session_id, seq, CHUNK)
        elif verdict is Delivery.APPLY:
            self.tables.chunks[session_id] = seq + 1
            if seq + 1 - int(self.tables.chunk_marks.get(session_id) or 0) >= CHUNK_MARK_EVERY:
                self.tables.chunk_marks[session_id] = seq + 1
            self.counters.chunks_skipped_undecoded += 1
        return True

    def _admit(self, session_id: str, seq: int) -> Delivery:
        expected = next_expected(self.tables, session_id)
        verdict = classify(expected, seq)
        if verdict is Delivery.DUPLICATE:
            self.counters.duplicates += 1
        elif (verdict is Delivery.GAP and session_id not in self.tables.chunks
              and seq - expected <= CHUNK_MARK_EVERY and not self._stalled(session_id)):
            # First record of the session since start/rebalance, within the unpersisted
            # chunks: re-synchronise (see the module docstring).
            self.counters.resyncs += 1
            verdict = Delivery.APPLY
        return verdict

    def _stalled(self, session_id: str) -> bool:
        raw = self.tables.sessions.get(session_id)
        return bool(raw and raw.get("stalled"))

    def _stall(self, session_id: str, partition: int) -> None:
        """Remember (in the table) that the session must not be re-synchronised past here."""
        if self._stalled(session_id):
            return
        state = SessionState.from_json(session_id, self.tables.sessions.get(session_id))
        state.stalled, state.partition = True, partition
        self.tables.sessions[session_id] = state.to_json()

    async def _report_gap(self, record: InboxRecord, session_id: str, seq: int,
                          type_: str) -> None:
        expected = next_expected(self.tables, session_id)
        self._stall(session_id, record.partition)
        self.counters.gaps += 1
        error = SequenceError(expected=expected, found=seq, type=type_)
        log.warning("session %s: gap at partition %d offset %d: %s; not folded past",
                    session_id, record.partition, record.offset, error)
        await self._dead_letter(record, error)

    async def _dead_letter(self, record: InboxRecord, error: Exception) -> None:
        self.counters.dead_letters += 1
        if not isinstance(error, SequenceError):
            log.warning("dead letter from %s[%d]@%d: %s: %s", record.topic, record.partition,
                        record.offset, type(error).__name__, error)
        await self.send(Outgoing.of(dead_letter(record, error)))

    async def _apply(self, record: InboxRecord, session_id: str, event: Event) -> bool:
        """Fold ``event``; False when it breaks a rule (dead-lettered, nothing changed)."""
        state = SessionState.from_json(session_id, self.tables.sessions.get(session_id))
        try:
            plan = _plan(state, event)
        except EventError as exc:
            # The fold cannot go on correctly: the session stops here (later seqs are gaps).
            self.counters.invalid_events += 1
            self._stall(session_id, record.partition)
            await self._dead_letter(record, exc)
            return False
        await self._publish(session_id, state, plan)
        if plan.changes:
            self.tables.nodes[f"{session_id}/{event.seq}"] = {"slot": plan.changes[0].slot,
                                                              "message": plan.message}
        state.next_seq, state.partition, state.stalled = event.seq + 1, record.partition, False
        self.tables.sessions[session_id] = state.to_json()  # the one atomic state write
        self.counters.applied += 1
        self.counters.steps_started += event.type == "step/start"
        return True

    async def _publish(self, session_id: str, state: SessionState, plan: FoldPlan) -> None:
        for change in plan.changes:
            await self.send(Outgoing(self.topics.derived_messages, change.key.encode(),
                                     json_bytes(change.to_json())))
        self.counters.derived_changes += len(plan.changes)
        if plan.sample is not None:
            self.counters.usage_samples += 1
            await self.send(Outgoing(self.usage_topic, plan.sample.model_key.encode(),
                                     json_bytes(plan.sample.to_json())))
            await self.send(Outgoing(self.topics.usage, f"session/{session_id}".encode(),
                                     json_bytes(session_record(session_id,
                                                               state.usage.totals))))
        if plan.fleet_changed and state.fleet is not None:
            await self.send(Outgoing(self.topics.fleet, session_id.encode(),
                                     json_bytes(state.fleet.to_json())))


@dataclass(slots=True)
class FoldPlan:
    """What one event changed (the state itself is updated in place)."""

    message: Any = None
    changes: list[MessageChange] = field(default_factory=list)
    sample: UsageSample | None = None
    fleet_changed: bool = False


def _plan(state: SessionState, event: Event) -> FoldPlan:
    """Fold ``event`` into ``state``; raises EventError before changing anything."""
    plan = FoldPlan()
    if event.type in SURFACE_TYPES and event.surface_op is not None:
        plan.message = projected_message(event)
        plan.changes = with_session(state.surface.apply(event, plan.message), state.session_id)
    if event.type in USAGE_TYPES:
        plan.sample = state.usage.apply(state.session_id, event)
    fleet = state.fleet or FleetStatus(state.session_id)
    plan.fleet_changed = fleet.apply(event)
    state.fleet = fleet
    return plan
