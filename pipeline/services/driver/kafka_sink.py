"""The runner's event sink on Kafka: short transactions per owned inbox partition.

One :class:`PartitionSink` per owned inbox partition p. Runners of every session of p emit
into it; a flusher task commits what has accumulated as ONE transaction of p's
transactional producer at most ``linger_ms`` after the first buffered record, or as soon as
the running transaction ends when a runner calls :meth:`PartitionSink.flush` (a step
boundary). Records emitted while a transaction is committing go into the next one, so
transactions batch by themselves under load. A transaction holds, atomically:

- the session events emitted since the previous transaction (for any session of p), in
  emission order, all to partition p of the session topic;
- dead letters of bad inbox records of p;
- the inbox offset of p up to which every command's effect is logged (see
  :class:`InboxOffsets`), via ``send_offsets_to_transaction``;
- the checkpoint of each session with events in it that is at a rest point (partition p of
  the checkpoint topic), and of the others when ``checkpoint_plan.py`` says so: the sink folds
  every event it buffers into the session's
  :class:`~pipeline.core.checkpoint.SessionCheckpoint`, so the fold written is exactly the
  fold of the committed events (``checkpointing.py``); the inbox offset's metadata carries
  the tail mark from which a takeover reads the newer events of the others.

So a command's claim (its ``agent/inbox/spliced`` record) and the advance of the inbox
offset past it commit together, or neither does. A crash between transactions loses only
uncommitted events; the next owner rebuilds every session from the committed ones, repairs
open turns, and the inbox re-delivers every command after the committed offset: the driver
recognises the ones already logged by their message id and skips them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from pipeline.adapters.kafka.checkpoints import CheckpointEntry, entry_of
from pipeline.adapters.kafka.records import OutRecord, check_fits
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.records import HEADER_TRACEPARENT, event_headers
from pipeline.core.approvals import DECISION_TYPE, REFUSED_TYPE
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.errors import BrokerError, DshError
from pipeline.core.events import Event
from pipeline.core.turn_config import CONFIG_TYPE
from pipeline.services.driver.admission import StepBudget
from pipeline.services.driver.checkpoint_plan import CheckpointPlan
from pipeline.services.driver.checkpointing import record_of
from pipeline.services.driver.inbox_offsets import (
    InboxOffsets,
    applied_from_metadata,
    dead_lettered_from_metadata,
)

__all__ = ["InboxOffsets", "PartitionSink", "applied_from_metadata",
           "dead_lettered_from_metadata", "logged_message_ids"]

log = logging.getLogger(__name__)

EventEncoder = Callable[[str, Event], bytes]
SPLICE_TYPE = "agent/inbox/spliced"
MAX_TRACED_FOLLOW_UPS = 10_000  # traceparents of follow-ups waiting for their turn
_SMALL_RECORD_MARGIN = 64 * 1024  # a value this far below the limit fits with key and headers
STEPS_PER_TRANSACTION = 4  # the driver's default step budget (docs/decisions/driver-latency.md)
RECORDS_PER_STEP = 16  # about what a step of a model that answers at once emits
RECENT_COMMITS = 4096  # commit timings kept for the latency split (bench, status)
_LOGS_MESSAGE_IDS = frozenset({SPLICE_TYPE, "user/message", CONFIG_TYPE})  # see below


def logged_message_ids(event: Event) -> Iterator[str]:
    """Command ids an event records as applied to the session: a message that entered it
    (splice or user message), a configure (its ``dsh-pipeline/config`` event) or an approval
    decision (taken or refused: ``dsh-pipeline/approval``, ``dsh-pipeline/approval-refused``)."""
    data = event.data
    if not isinstance(data, Mapping):
        return
    if event.type == SPLICE_TYPE:
        inserted = data.get("inserted")
        for item in inserted if isinstance(inserted, list) else ():
            if isinstance(item, Mapping) and isinstance(item.get("id"), str):
                yield item["id"]
    elif event.type == "user/message" and isinstance(data.get("id"), str):
        yield data["id"]
    elif event.type in (CONFIG_TYPE, DECISION_TYPE, REFUSED_TYPE) \
            and isinstance(data.get("messageId"), str):
        yield data["messageId"]


@dataclass(frozen=True, slots=True)
class CommitTiming:
    """Where one transaction's oldest record spent its time (seconds): ``waited`` from its
    emission until its transaction began, ``committing`` from there to the commit's answer.
    A reader sees the records a broker round trip or so after ``committing``."""

    waited: float
    committing: float
    records: int


class PartitionSink:
    """Buffers records of one partition and commits them in short transactions."""

    def __init__(self, producer: PartitionProducer, *, events_topic: str, inbox_topic: str,
                 partition: int, encode: EventEncoder, offsets: InboxOffsets,
                 on_logged: Callable[[str, str], None], linger_ms: float = 25.0,
                 wait_for_commit: bool = True, max_buffered: int = 20_000,
                 max_record_bytes: int | None = None, steps_per_transaction: int = 0,
                 checkpoints_topic: str | None = None,
                 on_checkpointed: Callable[[str, CheckpointEntry], None] | None = None
                 ) -> None:
        """``steps_per_transaction``: at most about this many sessions begin a step while
        one transaction commits (:class:`StepBudget`, awaited through
        :meth:`admit_step`); 0: no bound. ``checkpoints_topic`` None: no checkpoints
        (tests of the sink alone); ``on_checkpointed`` learns where each one was written."""
        self.producer = producer
        self.partition = partition
        self.offsets = offsets
        self._events_topic = events_topic
        self._inbox_topic = inbox_topic
        self._encode = encode
        self._on_logged = on_logged
        self._linger_s = linger_ms / 1000
        self._buffer: list[OutRecord] = []
        self._wake = asyncio.Event()
        self._committed_gen = 0
        self._emitted_gen = 0
        self._commit_done = asyncio.Condition()
        self.failure: DshError | None = None
        self.events_committed = 0
        self.transactions_aborted = 0  # failed commits (aborted, or the broker aborts them)
        self._closing = False
        self._urgent = False
        self._wait_for_commit = wait_for_commit
        self._max_buffered = max_buffered
        self._traced: dict[str, str] = {}  # follow-up message id -> caller's traceparent
        self._turn_traces: dict[str, str] = {}  # session -> traceparent of its open turn
        self._max_record_bytes = max_record_bytes
        self._checkpoints_topic = checkpoints_topic
        self._on_checkpointed = on_checkpointed
        self.folds: dict[str, SessionCheckpoint] = {}  # the sessions in memory
        self.plan = CheckpointPlan(mark=offsets.tail)  # which checkpoints, the tail mark
        self._touched: dict[str, None] = {}  # sessions with buffered events, emit order
        self._committing: dict[str, None] = {}  # ... whose transaction is under way
        self._first_emit: float | None = None  # monotonic: oldest record not yet committing
        self.recent_commits: deque[CommitTiming] = deque(maxlen=RECENT_COMMITS)
        # a transaction's worth of records: what the budget's steps emit when they run at once
        self.refill_below = steps_per_transaction * RECORDS_PER_STEP
        self.step_budget = (StepBudget(steps_per_transaction, stall_s=max(self._linger_s, 0.01),
                                       little_buffered=lambda: len(self._buffer)
                                       < self.refill_below)
                            if steps_per_transaction > 0 else None)

    def trace_follow_up(self, message_id: str, traceparent: str) -> None:
        """A follow-up came with the caller's (valid) W3C ``traceparent``: the events of the
        turn it starts carry it as a record header, from the turn's ``turn/start`` (when
        emitted together with the claim) or its ``user/message``, to its ``turn/end``."""
        if len(self._traced) >= MAX_TRACED_FOLLOW_UPS:
            del self._traced[next(iter(self._traced))]  # the oldest: its turn never came
        self._traced[message_id] = traceparent

    def track(self, checkpoint: SessionCheckpoint) -> None:
        """Fold the session's next events into ``checkpoint`` (a session entering memory)."""
        self.folds[checkpoint.session_id] = checkpoint

    def forget(self, session_id: str) -> bool:
        """Stop folding the session (it leaves memory); False while events of it are not
        committed yet (its latest checkpoint is not written)."""
        if session_id in self._touched or session_id in self._committing:
            return False
        if not self.plan.clean(session_id):  # its checkpoint goes with the next transaction
            self.plan.want(session_id)
            self._wake.set()
            return False
        self.folds.pop(session_id, None)
        return True

    def _fold(self, session_id: str, events: Sequence[Event]) -> None:
        if self._checkpoints_topic is None:
            return
        fold = self.folds.get(session_id)
        if fold is None:
            fold = self.folds[session_id] = SessionCheckpoint(session_id)
        fold.advance(events)
        self._touched[session_id] = None

    async def emit(self, session_id: str, events: Sequence[Event]) -> None:
        """Encode and buffer ``events``; they commit with the next transaction.

        Raises :class:`RecordTooLargeError` (buffering none of ``events``) when one would
        be above the record limit: the broker would refuse the whole transaction, and the
        partition would fail again at every retry. The session's runner fails alone.
        """
        self._raise_if_failed()
        if self._traced or self._turn_traces:
            self._emit_traced(session_id, events)
        else:
            self._emit_plain(session_id, events)

    def _emit_plain(self, session_id: str, events: Sequence[Event]) -> None:
        key = session_id.encode("utf-8")
        topic, partition, encode = self._events_topic, self.partition, self._encode
        records = [OutRecord(topic, key, encode(session_id, event), tuple(event_headers(event)),
                             partition) for event in events]
        limit = self._max_record_bytes
        if limit is not None:
            for event, record in zip(events, records, strict=True):
                if len(record.value or b"") > limit - _SMALL_RECORD_MARGIN:  # cheap test first
                    check_fits(record, limit,
                               f"session {session_id!r} event {event.seq} ({event.type})")
        self._buffer.extend(records)
        self._fold(session_id, events)
        for event in events:
            if event.type in _LOGS_MESSAGE_IDS:  # not the many chunks
                for message_id in logged_message_ids(event):
                    self._on_logged(session_id, message_id)
        self._emitted(time.monotonic())

    def _emitted(self, now: float) -> None:
        if self._first_emit is None:
            self._first_emit = now
        self._emitted_gen += 1
        self._wake.set()

    def _emit_traced(self, session_id: str, events: Sequence[Event]) -> None:
        """:meth:`emit` while some follow-up carries a traceparent (see
        :meth:`trace_follow_up`)."""
        key = session_id.encode("utf-8")
        trace = self._turn_traces.get(session_id)
        turn_start: int | None = None
        for event in events:
            if event.type == "turn/start":
                turn_start, trace = len(self._buffer), None
                self._turn_traces.pop(session_id, None)
            elif trace is None and event.type == "user/message":
                trace = self._claimed_trace(session_id, event, turn_start)
            self._buffer.append(OutRecord(
                self._events_topic, key, self._encode(session_id, event),
                tuple(event_headers(event, traceparent=trace)), self.partition))
            if event.type in _LOGS_MESSAGE_IDS:
                for message_id in logged_message_ids(event):
                    self._on_logged(session_id, message_id)
            if event.type == "turn/end":
                trace = None
                self._turn_traces.pop(session_id, None)
        self._fold(session_id, events)
        self._emitted(time.monotonic())

    def _claimed_trace(self, session_id: str, message: Event, turn_start: int | None
                       ) -> str | None:
        data = message.data
        message_id = data.get("id") if isinstance(data, Mapping) else None
        trace = self._traced.pop(message_id, None) if isinstance(message_id, str) else None
        if trace is None:
            return None
        self._turn_traces[session_id] = trace
        if turn_start is not None:  # the turn's first records, emitted with the claim
            header = (HEADER_TRACEPARENT, trace.encode("ascii"))
            self._buffer[turn_start:] = [replace(r, headers=(*r.headers, header))
                                         for r in self._buffer[turn_start:]]
        return trace

    async def admit_step(self) -> None:
        """Return when a session of this partition may begin a step (see ``__init__``)."""
        if self.step_budget is not None:
            await self.step_budget.admit()

    async def flush(self, session_id: str) -> None:
        """A step boundary: commit soon; wait until what was emitted so far is committed.

        Pipelined (``wait_for_commit=False``): wait only while more than ``max_buffered``
        records wait for a transaction (backpressure), so the next step starts while the
        previous one commits; the order of records and offsets is the same either way.
        """
        target = self._emitted_gen
        self._urgent = True  # a step boundary does not wait for the linger time
        self._wake.set()
        if self._wait_for_commit:
            await self._wait(lambda: self._committed_gen >= target)
        elif len(self._buffer) > self._max_buffered:
            await self._wait(lambda: len(self._buffer) <= self._max_buffered)
        self._raise_if_failed()

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        async with self._commit_done:
            await self._commit_done.wait_for(lambda: predicate() or self.failure is not None)

    def add(self, record: OutRecord) -> None:
        """Buffer ``record`` (e.g. a dead letter): it commits with the next transaction."""
        self._buffer.append(record)
        self._emitted(time.monotonic())

    def wake(self) -> None:
        """Something changed (an offset is done): commit soon even with no records."""
        self._wake.set()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise BrokerError(f"inbox partition {self.partition} is no longer writable: "
                              f"{self.failure}")

    def close(self) -> None:
        """Ask the flusher to commit what is buffered and stop (await its task)."""
        self._closing = True
        self._wake.set()
        if self.step_budget is not None:
            self.step_budget.open()

    async def run(self) -> None:
        """The flusher: one transaction per wake-up, at most every ``linger_ms``."""
        try:
            while True:
                await self._wake.wait()
                if not (self._closing or self._urgent):
                    await asyncio.sleep(self._linger_left())
                self._wake.clear()
                self._urgent = False
                await self.commit_pending()
                if self._closing:
                    return
        except Exception as exc:  # any failure ends this partition's writing; wake waiters
            self.failure = exc if isinstance(exc, DshError) else BrokerError(
                f"inbox partition {self.partition}: the transaction flusher failed: "
                f"{type(exc).__name__}: {exc}")
            if self.step_budget is not None:
                self.step_budget.open()  # the runners then fail at their next emit
            async with self._commit_done:
                self._commit_done.notify_all()
            raise self.failure from None

    def _linger_left(self) -> float:
        """What is left of the linger time of the oldest record not yet committing: it counts
        from that record's emit, as a Kafka producer's linger counts from a batch's first
        record, so records emitted during the previous commit do not linger again after it."""
        if self._first_emit is None:  # woken with no records (an offset is done)
            return self._linger_s
        return max(0.0, self._linger_s - (time.monotonic() - self._first_emit))

    async def commit_pending(self) -> None:
        """Commit buffered records and the offset progress now (no-op when nothing changed)."""
        records, self._buffer = self._buffer, []
        self._committing, self._touched = self._touched, {}
        events = len(records)
        chosen = self._checkpoint_sessions()
        records += self._checkpoint_records(chosen)
        generation = self._emitted_gen
        point = self.offsets.advance()
        first_emit, self._first_emit = self._first_emit, None
        if self.step_budget is not None:
            self.step_budget.renew()
        if records or point is not None:
            offsets = ({(self._inbox_topic, self.partition): point} if point is not None
                       else None)
            began = time.monotonic()
            try:
                written = await self.producer.commit(records, offsets)
            except Exception:
                self.transactions_aborted += 1
                raise
            self._checkpointed(records[events:], written[events:])
            self.plan.committed(self._committing, chosen,
                                self._events_end(records[:events], written))
            self.recent_commits.append(CommitTiming(
                began - (first_emit if first_emit is not None else began),
                time.monotonic() - began, events))
            self.events_committed += sum(1 for r in records if r.topic == self._events_topic)
        self._committing = {}
        self._committed_gen = generation
        async with self._commit_done:
            self._commit_done.notify_all()

    def _checkpoint_sessions(self) -> list[str]:
        """The sessions whose checkpoint this transaction writes; sets the tail mark its
        inbox offset carries (``checkpoint_plan.py``)."""
        if self._checkpoints_topic is None:
            return []
        chosen = self.plan.choose(self._committing, self.folds, closing=self._closing)
        self.offsets.tail = self.plan.mark_for(self._committing, chosen)
        return chosen

    def _checkpoint_records(self, sessions: Sequence[str]) -> list[OutRecord]:
        topic, limit = self._checkpoints_topic, self._max_record_bytes or 8 * 1024 * 1024
        if topic is None:
            return []
        return [record_of(topic, self.partition, self.folds[session_id], limit)
                for session_id in sessions]

    def _events_end(self, records: Sequence[OutRecord], written: Sequence[int]) -> int | None:
        """One past the offset of the last session-topic record of ``records``."""
        for index in range(len(records) - 1, -1, -1):
            if records[index].topic == self._events_topic:
                return written[index] + 1
        return None

    def _checkpointed(self, records: Sequence[OutRecord], offsets: Sequence[int]) -> None:
        if self._on_checkpointed is None:
            return
        for record, offset in zip(records, offsets, strict=True):
            entry = entry_of(record.headers, offset)  # as written, not as the fold is now
            if entry is not None:
                self._on_checkpointed((record.key or b"").decode("utf-8"), entry)
