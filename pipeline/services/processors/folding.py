"""One session-topic record -> table updates and published changes.

The decisions are core's pure folds (:mod:`pipeline.core.projection`, ``usage``, ``fleet``);
this module only moves their state in and out of the tables and sends what they return.
Tables are plain ``MutableMapping`` values here (faust tables in the worker, dicts in unit
tests); sending goes through one ``Send`` callable (faust's producer in the worker).

Delivery rules (DESIGN.md section 2): a seq below the next expected one is a duplicate
(skipped, counted); a seq above it is a gap (counted, logged, dead-lettered with the reason,
never folded past); an ``assistant/chunk`` is recognised by its ``dsh.type`` header and only
advances the session's cursor, without being decoded; a record that does not decode, or an
event that breaks a surface rule, is dead-lettered and processing goes on.
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
from pipeline.core.events import SURFACE_TYPES, Event, dumps_json
from pipeline.core.fleet import FleetStatus
from pipeline.core.projection import MessageChange, SurfaceSlots, with_session
from pipeline.core.usage import SessionUsage, UsageSample, session_record
from pipeline.core.validation import projected_message
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.settings import TopicNames

log = logging.getLogger(__name__)

CHUNK: Final = "assistant/chunk"

Decoder = Callable[[bytes], tuple[str, Event]]


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
Table = MutableMapping[str, Any]


@dataclass(frozen=True, slots=True)
class SessionTables:
    """The co-partitioned tables keyed by session (``nodes`` by ``<session>/<seq>``)."""

    cursor: Table
    surface: Table
    nodes: Table
    usage: Table
    fleet: Table


def classify(expected: int, seq: int) -> Delivery:
    if seq < expected:
        return Delivery.DUPLICATE
    return Delivery.GAP if seq > expected else Delivery.APPLY


def json_bytes(value: Any) -> bytes | None:
    return None if value is None else dumps_json(value).encode("utf-8")


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
        verdict = self._admit(record, session_id, event.seq, event.type)
        if verdict is Delivery.GAP:
            await self._report_gap(record, session_id, event.seq, event.type)
        elif verdict is Delivery.APPLY:
            await self._apply(record, session_id, event)

    async def _skip_chunk(self, record: InboxRecord) -> bool:
        """A chunk with readable type+seq headers: advance the cursor, never decode."""
        try:
            type_, seq = header_type_and_seq(record.headers)
            session_id = session_id_of_key(record.key)
        except CodecError:
            return False  # malformed headers or key: decoding decides (and dead-letters)
        if type_ != CHUNK or seq is None:
            return False
        verdict = self._admit(record, session_id, seq, CHUNK)
        if verdict is Delivery.GAP:
            await self._report_gap(record, session_id, seq, CHUNK)
        elif verdict is Delivery.APPLY:
            self.tables.cursor[session_id] = seq + 1
            self.counters.chunks_skipped_undecoded += 1
        return True

    def _admit(self, record: InboxRecord, session_id: str, seq: int, type_: str) -> Delivery:
        verdict = classify(int(self.tables.cursor.get(session_id, 0)), seq)
        if verdict is Delivery.DUPLICATE:
            self.counters.duplicates += 1
        return verdict

    async def _report_gap(self, record: InboxRecord, session_id: str, seq: int,
                          type_: str) -> None:
        expected = int(self.tables.cursor.get(session_id, 0))
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

    async def _apply(self, record: InboxRecord, session_id: str, event: Event) -> None:
        try:
            plan = self._plan(session_id, event)
        except EventError as exc:
            # The fold cannot go on correctly: the session stops here (later seqs are gaps).
            self.counters.invalid_events += 1
            await self._dead_letter(record, exc)
            return
        await self._commit_surface(session_id, event, plan)
        await self._commit_usage(session_id, plan)
        await self._commit_fleet(session_id, plan, record.partition)
        self.tables.cursor[session_id] = event.seq + 1
        self.counters.applied += 1

    def _plan(self, session_id: str, event: Event) -> FoldPlan:
        """Every fold's new state for ``event``, computed before anything is written."""
        plan = FoldPlan(event)
        if event.type in SURFACE_TYPES and event.surface_op is not None:
            plan.message = projected_message(event)
            plan.surface = SurfaceSlots.from_json(self.tables.surface.get(session_id))
            plan.changes = with_session(plan.surface.apply(event, plan.message), session_id)
        if event.type in USAGE_TYPES:
            plan.usage = SessionUsage.from_json(self.tables.usage.get(session_id))
            plan.sample = plan.usage.apply(session_id, event)
        raw = self.tables.fleet.get(session_id)
        plan.fleet = FleetStatus.from_json(_status_fields(raw)) if raw else FleetStatus(session_id)
        plan.fleet_changed = plan.fleet.apply(event)
        return plan

    async def _commit_surface(self, session_id: str, event: Event, plan: FoldPlan) -> None:
        if plan.surface is None or not plan.changes:
            return
        self.tables.nodes[f"{session_id}/{event.seq}"] = {"slot": plan.changes[0].slot,
                                                          "message": plan.message}
        self.tables.surface[session_id] = plan.surface.to_json()
        for change in plan.changes:
            await self.send(Outgoing(self.topics.derived_messages, change.key.encode(),
                                     json_bytes(change.to_json())))
        self.counters.derived_changes += len(plan.changes)

    async def _commit_usage(self, session_id: str, plan: FoldPlan) -> None:
        if plan.usage is None:
            return
        self.tables.usage[session_id] = plan.usage.to_json()
        if plan.sample is None:
            return
        self.counters.usage_samples += 1
        await self.send(_usage_sample_record(self.usage_topic, plan.sample))
        value = session_record(session_id, plan.usage.totals)
        await self.send(Outgoing(self.topics.usage, f"session/{session_id}".encode(),
                                 json_bytes(value)))

    async def _commit_fleet(self, session_id: str, plan: FoldPlan, partition: int) -> None:
        assert plan.fleet is not None
        self.tables.fleet[session_id] = {**plan.fleet.to_json(), "partition": partition}
        if plan.fleet_changed:
            await self.send(Outgoing(self.topics.fleet, session_id.encode(),
                                     json_bytes(plan.fleet.to_json())))


USAGE_TYPES: Final = frozenset({"assistant/message", "request/header"})


@dataclass(slots=True)
class FoldPlan:
    """What one event does to each fold (None: that fold is untouched)."""

    event: Event
    message: Any = None
    surface: SurfaceSlots | None = None
    changes: list[MessageChange] = field(default_factory=list)
    usage: SessionUsage | None = None
    sample: UsageSample | None = None
    fleet: FleetStatus | None = None
    fleet_changed: bool = False


def _status_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != "partition"}


def _usage_sample_record(topic: str, sample: UsageSample) -> Outgoing:
    return Outgoing(topic, sample.model_key.encode(), json_bytes(sample.to_json()))
