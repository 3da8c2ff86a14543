"""One fetched batch of the session topic -> a plan of what it changes: the pure batch step.

:func:`plan_batch` folds a batch's records with core's pure folds and returns a
:class:`BatchPlan`: the outputs to send, the records to dead-letter, the node writes, the
session records and cursors to write, and the batch's offsets. It never awaits and does no
I/O; its tables are plain mappings (faust tables in the worker, dicts in tests) that it only
reads, and so are the records a persist holds and has not written yet
(:attr:`FoldState.pending`). What it does change is in memory: the decoded session states it
folds and the cursors (the fold's caches, :attr:`FoldState.states` and
:attr:`FoldState.cursors`, ahead of the tables until the next persist) and the counters.
Performing a plan is the executor's (:class:`pipeline.adapters.faust.executor.PlanExecutor`,
which calls :meth:`FoldState.start` and :meth:`FoldState.go_on`; :mod:`.folding` wires it).

The rules it keeps (DESIGN.md section 2, :mod:`.folding` for the crash rules):

- A seq below the session's cursor is a duplicate (skipped, counted); at the cursor it is
  applied; above it, the worker's state is behind the log: when the state can be healed
  the plan stops there and *wants* the session's records read back (:class:`ReadBack`);
  :func:`continue_plan` with them folds them first and goes on. Only a gap the log itself
  has, or one after an event the session stopped at, is reported (dead-lettered with
  the reason, the session stalled).
- An ``assistant/chunk`` only moves its session's cursor (recognised by header, never
  decoded). A record that does not decode, or an event that breaks a rule or would make the
  session's table records exceed the record limit, is dead-lettered and the session stops
  there.
- Outputs are in fold order: each event's derived changes (to the version the route names)
  and usage sample, then each changed session's last fleet status and usage totals.
- Records read back by a heal are below the committed offset: nothing is dead-lettered for
  them, and a heal never nests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from pipeline.adapters.kafka.records import OutRecord
from pipeline.adapters.kafka.session_span import record_seq
from pipeline.codec.outputs import OutputCodecs
from pipeline.codec.records import ConsumedRecord, session_first_header, source_headers
from pipeline.core.dedup import Delivery
from pipeline.core.errors import BrokerError, CodecError, EventError, SequenceError
from pipeline.core.events import Event
from pipeline.core.usage import session_record
from pipeline.services.processors.counters import DeliveryCounters
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


class Decoder(Protocol):
    def __call__(self, data: bytes, /) -> tuple[str, Event]: ...


class DerivedTopics(Protocol):
    """Which version of the derived messages a record's changes go to, read in memory
    (a :class:`pipeline.adapters.kafka.projection_follow.ProjectionFollow` in the
    worker); None: publish nothing."""

    def topic_for(self, partition: int, offset: int) -> str | None: ...
    # The partition of a change of an event in ``partition`` of the session topic, in the
    # version topic_for named (both read the active version in one synchronous step).
    def partition_of(self, partition: int) -> int | None: ...


@dataclass(slots=True)
class FoldState:
    """What the planner reads (tables, cursors) and the in-memory fold it moves on: the
    planner of :class:`pipeline.adapters.faust.executor.PlanExecutor`."""

    tables: SessionTables
    decode: Decoder
    topics: TopicNames
    usage_topic: str
    outputs: OutputCodecs
    counters: DeliveryCounters
    max_record_bytes: int
    route: DerivedTopics | None = None   # None: the derived-messages topic of ``topics``
    can_heal: bool = False                # whether a gap may be read back from the log
    states: dict[str, SessionState] = field(default_factory=dict)  # decoded, folded so far
    # The seq each session expects next, as folded so far (ahead of the tables).
    cursors: dict[str, int] = field(default_factory=dict)
    pending: PendingView | None = None    # the records a persist holds (None: no persists)

    def start(self, records: Sequence[ConsumedRecord]) -> BatchPlan:
        """The plan of a (non-empty) batch, nothing folded yet: :meth:`go_on` folds it."""
        self.counters.records += len(records)
        return BatchPlan.of(records)

    def go_on(self, plan: BatchPlan,
              found: Sequence[ConsumedRecord] | None = None) -> BatchPlan:
        return continue_plan(self, plan, found)


class PendingView(Protocol):
    """What a persist holds and has not written yet (newer than the tables)."""

    def taken(self, session_id: str) -> tuple[Any, int | None]: ...
    def unwritten(self) -> set[str]: ...


@dataclass(frozen=True, slots=True)
class ReadBack:
    """The session's records from ``from_seq`` on, below ``before_offset`` of ``partition``
    (the heal's read of the log), one per seq in seq order; ``seq``: the record's that
    found the gap."""

    partition: int
    session_id: str
    from_seq: int
    before_offset: int
    seq: int


@dataclass(slots=True)
class BatchPlan:
    """What one batch of one partition changes, in the order it must be performed."""

    partition: int
    span: tuple[int, int]   # its records' offsets: first, last + 1
    records: Sequence[ConsumedRecord]
    outputs: list[OutRecord] = field(default_factory=list)
    letters: list[tuple[ConsumedRecord, Exception]] = field(default_factory=list)
    # ``nodes`` writes in fold order (None: delete); drained as they join the pending writes
    node_writes: list[tuple[str, Any]] = field(default_factory=list)
    states: dict[str, SessionState] = field(default_factory=dict)  # every session touched
    # Set when the plan is done: the session records to write and the cursors moved by
    # chunks only (:meth:`pipeline.adapters.faust.pending.PendingWrites.add`).
    to_write: dict[str, SessionState] = field(default_factory=dict)
    marks: dict[str, int] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)            # whose record to write
    started: dict[str, int] = field(default_factory=dict)   # cursor before the batch
    cursors: dict[str, int] = field(default_factory=dict)   # cursor after it
    wants: ReadBack | None = None   # set: call continue_plan with those records
    fleet: set[str] = field(default_factory=set)            # fleet status to publish
    usage: set[str] = field(default_factory=set)            # session usage to publish
    position: int = 0               # the next record to fold
    healing: bool = False
    heal_tried: set[int] = field(default_factory=set)       # positions already read back

    @classmethod
    def of(cls, records: Sequence[ConsumedRecord]) -> BatchPlan:
        first, last = records[0], records[-1]
        return cls(first.partition, (first.offset, last.offset + 1), records)

    @property
    def done(self) -> bool:
        return self.wants is None and self.position >= len(self.records)

    def sessions(self) -> set[str]:
        """Every session the plan touched."""
        return set(self.started)


def plan_batch(state: FoldState, records: Sequence[ConsumedRecord]) -> BatchPlan:
    """The plan of a (non-empty) batch of one partition, in offset order; see the module
    doc. When ``wants`` is set, the plan is not done: :func:`continue_plan` it with the
    records read back."""
    return state.go_on(state.start(records))


def continue_plan(state: FoldState, plan: BatchPlan,
                  read_back: Sequence[ConsumedRecord] | None = None) -> BatchPlan:
    """Go on with ``plan``: fold ``read_back`` (what ``plan.wants`` asked for) first, then
    the rest of its records; at the end, its sessions' last values join the outputs and
    its writes are settled (:func:`_settle`)."""
    if plan.wants is not None:
        wanted, plan.wants = plan.wants, None
        _heal(state, plan, wanted, read_back or ())
    while plan.position < len(plan.records):
        _fold_record(state, plan, plan.records[plan.position])
        if plan.wants is not None:
            return plan   # the record at ``position`` is folded again after the read
        plan.position += 1
    _last_values(state, plan)
    _settle(state, plan)
    return plan


def _settle(state: FoldState, plan: BatchPlan) -> None:
    """The done plan's writes: a record for each session an event changed, a cursor for
    each that only chunks moved; its cursors join the fold's, and the cached states stay
    bounded (:data:`STATE_CACHE_MAX`)."""
    for session_id, started in plan.started.items():
        cursor = plan.cursors[session_id]
        session = plan.states.get(session_id) or state.states.get(session_id)
        if session is not None:   # a record pending (or written later) holds the cursor
            session.next_seq = max(session.next_seq, cursor)
        if session_id in plan.dirty:
            plan.to_write[session_id] = plan.states[session_id]
        elif cursor > started:
            plan.marks[session_id] = cursor
    state.cursors.update(plan.cursors)
    if len(state.states) > STATE_CACHE_MAX:
        keep = (plan.states.keys() | plan.marks.keys()
                | (state.pending.unwritten() if state.pending else set()))
        kept = {sid: state.states[sid] for sid in keep if sid in state.states}
        state.states.clear()
        state.states.update(kept)


def _cursor(state: FoldState, plan: BatchPlan, session_id: str) -> int:
    """The seq the session expects next (moved in the batch)."""
    cursor = plan.cursors.get(session_id)
    if cursor is None:
        cursor = plan.cursors[session_id] = plan.started[session_id] = folded_cursor(
            state, session_id)
    return cursor


def folded_cursor(state: FoldState, session_id: str) -> int:
    """The seq the session expects next as folded so far: the fold's cursor, else the
    newest of the tables and what a persist holds and has not written (0: unknown)."""
    cursor = state.cursors.get(session_id)
    if cursor is not None:
        return cursor
    taken = 0
    if state.pending is not None:
        record, mark = state.pending.taken(session_id)
        taken = max(int(record["next"]) if record is not None else 0, mark or 0)
    return max(next_expected(state.tables, session_id), taken)


def _session(state: FoldState, plan: BatchPlan, session_id: str) -> SessionState:
    found = plan.states.get(session_id) or state.states.get(session_id)
    if found is None:
        found = SessionState.from_json(session_id, stored_record(state, session_id))
        state.states[session_id] = found
    plan.states[session_id] = found
    return found


def stored_record(state: FoldState, session_id: str) -> Any:
    """The session's newest record outside the fold's cache: the one a persist holds and
    has not written yet, else the table's (None: none)."""
    if state.pending is not None:
        record, _ = state.pending.taken(session_id)
        if record is not None:
            return record
    return state.tables.sessions.get(session_id)


def _fold_record(state: FoldState, plan: BatchPlan, record: ConsumedRecord) -> None:
    seq = chunk_seq(record.headers)
    session_id = session_of(record.key) if seq is not None else None
    if seq is not None and session_id is not None:
        if _admit(state, plan, record, session_id, seq, CHUNK) is Delivery.APPLY:
            plan.cursors[session_id] = seq + 1
            state.counters.chunks_skipped_undecoded += 1
        return
    try:
        session_id, event = state.decode(record.value or b"")
    except CodecError as exc:
        _dead_letter(plan, record, exc)
        return
    verdict = _admit(state, plan, record, session_id, event.seq, event.type)
    if verdict is Delivery.APPLY and _apply(state, plan, record, session_id, event):
        plan.cursors[session_id] = event.seq + 1


def _admit(state: FoldState, plan: BatchPlan, record: ConsumedRecord, session_id: str,
           seq: int, type_: str) -> Delivery:
    """Whether to apply the record: a gap is read back from the log when it can be (the
    plan then wants it), else reported."""
    verdict = classify(_cursor(state, plan, session_id), seq)
    if verdict is Delivery.DUPLICATE:
        state.counters.duplicates += 1
    elif verdict is Delivery.GAP:
        if _can_heal(state, plan, session_id):
            plan.heal_tried.add(plan.position)
            plan.wants = ReadBack(record.partition, session_id,
                                  _cursor(state, plan, session_id), record.offset, seq)
        else:
            _report_gap(state, plan, record, session_id, seq, type_)
    return verdict


def _can_heal(state: FoldState, plan: BatchPlan, session_id: str) -> bool:
    """Not for a session stopped at an invalid event or a real gap (its later seqs are gaps
    of the log's own), nor while healing (no nesting), nor twice for one record."""
    return (state.can_heal and not plan.healing and plan.position not in plan.heal_tried
            and not _session(state, plan, session_id).stalled)


def _heal(state: FoldState, plan: BatchPlan, wanted: ReadBack,
          earlier: Sequence[ConsumedRecord]) -> None:
    """Fold the records read back for ``wanted`` (the log is right); the record that wanted
    them is folded again after: applied when they filled the gap, else reported."""
    session_id, expected, seq = wanted.session_id, wanted.from_seq, wanted.seq
    record = plan.records[plan.position]
    plan.healing = True
    try:
        for found in earlier:
            cursor = _cursor(state, plan, session_id)
            if cursor >= seq or record_seq(found) != cursor:
                break   # done, or a hole in the log below the record
            _fold_record(state, plan, found)
            if _cursor(state, plan, session_id) == cursor:
                break   # refused by the fold (the log's own fault, handled back then)
    finally:
        plan.healing = False
    cursor = _cursor(state, plan, session_id)
    state.counters.sessions_healed += cursor == seq
    state.counters.records_healed += cursor - expected
    log.warning("session %s: the worker expected seq %d at %s[%d] offset %d, found %d: "
                "%s %d records read back from the log", session_id, expected, record.topic,
                record.partition, record.offset, seq,
                "rebuilt from" if cursor == seq else "NOT healed (a hole in the log) after",
                cursor - expected)


def _stall(state: FoldState, plan: BatchPlan, session_id: str, partition: int) -> None:
    """Remember (in the session's record) that it stopped at a gap or an invalid event."""
    session = _session(state, plan, session_id)
    if not session.stalled:
        session.stalled, session.partition = True, partition
        plan.dirty.add(session_id)


def _report_gap(state: FoldState, plan: BatchPlan, record: ConsumedRecord, session_id: str,
                seq: int, type_: str) -> None:
    expected = _cursor(state, plan, session_id)
    _stall(state, plan, session_id, record.partition)
    state.counters.gaps += 1
    error = SequenceError(expected=expected, found=seq, type=type_)
    log.warning("session %s: gap at partition %d offset %d: %s; not folded past",
                session_id, record.partition, record.offset, error)
    _dead_letter(plan, record, error)


def _dead_letter(plan: BatchPlan, record: ConsumedRecord, error: Exception) -> None:
    if not plan.healing:   # read back below the committed offset: handled back then
        plan.letters.append((record, error))


def _apply(state: FoldState, plan: BatchPlan, record: ConsumedRecord, session_id: str,
           event: Event) -> bool:
    """Fold ``event``; False when it breaks a rule (dead-lettered, nothing changed)."""
    session = _session(state, plan, session_id)
    try:
        refuse_oversize(session, event, len(record.value or b""), state.max_record_bytes)
        folded = plan_event(session, event)
    except EventError as exc:
        # The fold cannot go on correctly: the session stops here (later seqs are gaps).
        state.counters.invalid_events += 1
        _stall(state, plan, session_id, record.partition)
        _dead_letter(plan, record, exc)
        return False
    plan.outputs += _outputs(state, session_id, event.seq, folded, record)   # may refuse
    if folded.changes:   # the nodes table holds the live surface's messages only
        plan.node_writes += [(f"{session_id}/{seq}", None) for seq in folded.removed]
        plan.node_writes.append((f"{session_id}/{event.seq}",
                                 {"slot": folded.changes[0].slot, "message": folded.message}))
    if event.seq == 0:
        session.first_offset = record.offset
    session.next_seq, session.partition, session.stalled = (event.seq + 1, record.partition,
                                                            False)
    plan.dirty.add(session_id)
    if folded.sample is not None:
        plan.usage.add(session_id)
    if folded.fleet_changed:
        plan.fleet.add(session_id)
    state.counters.applied += 1
    state.counters.steps_started += event.type == "step/start"
    return True


def _outputs(state: FoldState, session_id: str, seq: int, folded: FoldPlan,
             record: ConsumedRecord) -> list[OutRecord]:
    """What must be sent for one event: each message change (to the version the route
    names) and the usage sample.

    Raises :class:`BrokerError` for a change above the producer's record limit, before
    anything is written: the ``nodes`` record of the message is as large, and a table write
    the producer refuses stops every later table write of the worker (faust's producer
    buffer dies with it)."""
    found = []
    if folded.changes:
        encode = state.outputs.derived.encode_change
        values = [(change.key.encode(), encode(change)) for change in folded.changes]
        largest = max(len(value or b"") for _, value in values)
        if largest > state.max_record_bytes:
            raise BrokerError(f"session {session_id} seq {seq}: its derived change is "
                              f"{largest:,} bytes, above the {state.max_record_bytes:,}-"
                              f"byte record limit of the producer; not folded")
        topic: str | None = state.topics.derived_messages
        partition: int | None = None
        if state.route is not None:
            topic = state.route.topic_for(record.partition, record.offset)
            partition = state.route.partition_of(record.partition)
        if topic is not None:
            source = source_headers(record.partition, record.offset)
            found += [OutRecord(topic, key, value, source, partition) for key, value in values]
            state.counters.derived_changes += len(values)
    if folded.sample is not None:
        state.counters.usage_samples += 1
        found.append(OutRecord(state.usage_topic, folded.sample.model_key.encode(),
                               json_bytes(folded.sample.to_json())))
    return found


def _last_values(state: FoldState, plan: BatchPlan) -> None:
    """The batch's last fleet status and usage totals of each session it changed, with the
    batch's last offset as their source position (readers: ``source_position``); a fleet
    record also names where the session's first event lies (``export``, ``tail`` start
    there: :func:`~pipeline.codec.records.session_first_offset`)."""
    source = source_headers(plan.partition, plan.span[1] - 1)
    for session_id in sorted(plan.fleet):
        session = plan.states[session_id]
        if session.fleet is not None:
            headers = (*source, session_first_header(session.first_offset))
            plan.outputs.append(OutRecord(state.topics.fleet, session_id.encode(),
                                          state.outputs.fleet.encode(session.fleet.to_json()),
                                          headers))
    for session_id in sorted(plan.usage):
        totals = plan.states[session_id].usage.totals
        plan.outputs.append(OutRecord(state.topics.usage, f"session/{session_id}".encode(),
                                      state.outputs.usage.encode(session_record(session_id,
                                                                                totals)),
                                      source))
