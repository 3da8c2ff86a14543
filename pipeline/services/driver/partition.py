"""One owned inbox partition: its producer, its sink, its sessions and their runners.

Built on assignment (:func:`build_partition`): start the transactional producer of the
partition (this fences any older owner and aborts its open transaction), read the same
partition of the session topic read_committed up to its end, rebuild each session's
:class:`SessionLog`, create a runner per session and let it repair an open turn
(``runner.recover()``), then continue pending inbox work. Inbox commands are then
dispatched to the session's runner; each session's turns run in one task, off the poll loop.

One writer per session: a session whose seq-0 record is marked as published from a dsh file
(``dsh.writer``, by ``import`` or ``ship``) is written by dsh through its shipper. The driver
holds no runner for it: it never repairs its open turn (the shipper will append that turn's
next events) and dead-letters inbox commands for it (rule ``session-not-driven``).

Idempotency after a crash or takeover: every message command (followup, steer, inject)
enters the log as an ``agent/inbox/spliced`` record carrying its message id, and every
configure as a ``dsh-pipeline/config`` record carrying its id; a re-delivered command whose id
is already in the log is skipped and its offset marked done. A cancel's id travels in the
inbox commit's metadata instead (:class:`InboxOffsets`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.dlq import dead_letter
from pipeline.adapters.kafka.records import (
    InboxRecord,
    header_value,
    inbox_record_limit,
    record_bytes,
)
from pipeline.adapters.kafka.session_reader import Decoder, read_session_partition
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.records import HEADER_TRACEPARENT
from pipeline.core.errors import CodecError, DshError, EventError
from pipeline.core.events import Event
from pipeline.core.genai_trace import TraceParent
from pipeline.core.inbox import Approve, Configure, FollowUp, InboxCommand, Inject, Steer
from pipeline.core.log import Mode, SessionLog
from pipeline.services.driver.kafka_sink import (
    EventEncoder,
    InboxOffsets,
    PartitionSink,
    applied_from_metadata,
    dead_lettered_from_metadata,
    logged_message_ids,
)
from pipeline.services.driver.metrics import RunnerMetrics
from pipeline.settings import Settings

log = logging.getLogger(__name__)


class SessionRunnerLike(Protocol):
    """What the driver needs of a session runner (``runner.SessionRunner``)."""

    async def recover(self) -> None: ...
    def submit(self, command: InboxCommand) -> None: ...
    async def run_until_idle(self) -> None: ...
    async def dispose(self) -> None: ...
    @property
    def busy(self) -> bool: ...
    @property
    def approval_deadline(self) -> int | None: ...
    def expire_approval(self) -> bool: ...


RunnerFactory = Callable[[SessionLog, PartitionSink], SessionRunnerLike]
CommandDecoder = Callable[[bytes], InboxCommand]


@dataclass(slots=True)
class DriverMetrics:
    """Plain counters (``snapshot``), plus the runners' labelled series (``runner``)."""

    commands: int = 0
    duplicates: int = 0
    redelivered: int = 0
    dead_letters: int = 0
    sessions_rebuilt: int = 0
    turns_repaired: int = 0
    session_failures: int = 0
    partitions_built: int = 0
    partitions_lost: int = 0
    fenced: int = 0
    broker_failures: int = 0
    pauses: int = 0
    events_committed: int = 0
    transactions: int = 0
    transactions_aborted: int = 0
    runner: RunnerMetrics = field(default_factory=RunnerMetrics)

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__ if name != "runner"}


@dataclass(slots=True)
class SessionSlot:
    """A session owned through its partition: log, runner, and the offsets it works on."""

    session_id: str
    log: SessionLog
    runner: SessionRunnerLike | None
    message_ids: set[str] = field(default_factory=set)
    offsets: list[int] = field(default_factory=list)      # submitted, not yet idle
    awaiting: dict[str, int] = field(default_factory=dict)  # message id -> inbox offset
    task: asyncio.Task[None] | None = None
    failure: str | None = None
    writer: str | None = None  # another writer's mark: the driver never writes the session

    @property
    def driving(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(frozen=True, slots=True)
class PartitionContext:
    """What every owned partition shares (built once by the service)."""

    settings: Settings
    group_id: str
    decode_event: Decoder
    encode_event: EventEncoder
    decode_command: CommandDecoder
    runner_factory: RunnerFactory
    metrics: DriverMetrics
    linger_ms: float = 25.0
    rebuild_mode: Mode = "strict"
    pipelined_flush: bool = False  # True: a step boundary does not wait for its commit
    steps_per_transaction: int = 0  # PartitionSink's step budget (0: unbounded)


class OwnedPartition:
    """Everything the driver holds for one owned inbox partition."""

    def __init__(self, ctx: PartitionContext, partition: int, producer: PartitionProducer,
                 committed: int, metadata: str = "") -> None:
        self.ctx = ctx
        self.partition = partition
        self.producer = producer
        topics = ctx.settings.topics
        self.sessions: dict[str, SessionSlot] = {}
        self.sink = PartitionSink(producer, events_topic=topics.session_events,
                                  inbox_topic=topics.inbox, partition=partition,
                                  encode=ctx.encode_event,
                                  offsets=InboxOffsets(committed,
                                                       applied_from_metadata(metadata),
                                                       dead_lettered_from_metadata(metadata),
                                                       metadata=metadata),
                                  on_logged=self._on_logged, linger_ms=ctx.linger_ms,
                                  wait_for_commit=not ctx.pipelined_flush,
                                  max_record_bytes=ctx.settings.max_record_bytes,
                                  steps_per_transaction=ctx.steps_per_transaction)
        self.sink_task: asyncio.Task[None] | None = None
        self._approval_timers: dict[str, asyncio.TimerHandle] = {}
        self.accepting = False
        self.released = False

    @property
    def turns_in_flight(self) -> int:
        return sum(1 for slot in self.sessions.values() if slot.driving)

    def start_sink(self) -> None:
        self.sink_task = asyncio.create_task(self.sink.run(), name=f"sink-p{self.partition}")

    def adopt(self, session_id: str, events: list[Event]) -> SessionSlot:
        """A slot for a session rebuilt from its committed events (failed if invalid)."""
        log_ = SessionLog(session_id, mode=self.ctx.rebuild_mode)
        slot = SessionSlot(session_id, log_, None)
        try:
            log_.extend(events)
        except EventError as exc:
            slot.failure = f"its log on the session topic does not rebuild: {exc}"
            log.error("session %s in partition %d: %s", session_id, self.partition, slot.failure)
            self.sessions[session_id] = slot
            return slot
        for event in events:
            slot.message_ids.update(logged_message_ids(event))
        slot.runner = self.ctx.runner_factory(log_, self.sink)
        self.sessions[session_id] = slot
        return slot

    def adopt_written_elsewhere(self, session_id: str, writer: str) -> SessionSlot:
        """A slot, without runner, for a session another writer owns (its log not rebuilt)."""
        slot = SessionSlot(session_id, SessionLog(session_id, mode=self.ctx.rebuild_mode), None,
                           writer=writer)
        self.sessions[session_id] = slot
        return slot

    def _on_logged(self, session_id: str, message_id: str) -> None:
        slot = self.sessions.get(session_id)
        if slot is None:
            return
        slot.message_ids.add(message_id)
        offset = slot.awaiting.pop(message_id, None)
        if offset is not None:
            self.sink.offsets.done(offset)

    # -- inbox records -------------------------------------------------------------------

    def handle(self, record: InboxRecord) -> None:
        """Dispatch one inbox record of this partition (never raises for bad input)."""
        offsets = self.sink.offsets
        if offsets.seen(record.offset):
            self.ctx.metrics.redelivered += 1
            return
        offsets.start(record.offset)
        if offsets.already_dead_lettered(record.offset):  # before a crash, its offset not yet
            offsets.dead_letter(record.offset)            # committed: not a second time
            self.ctx.metrics.redelivered += 1
            self.sink.wake()
            return
        self.ctx.metrics.commands += 1
        limit = inbox_record_limit(self.ctx.settings.max_record_bytes)
        if record_bytes(record.key, record.value, record.headers) > limit:
            self._dead_letter(record, EventError(
                f"the inbox record is above {limit:,} bytes: the events it would become "
                "could not be written whole (DSH_MAX_RECORD_BYTES)", rule="record-too-large"))
            return
        try:
            command = self._command_of(record)
        except DshError as exc:
            self._dead_letter(record, exc)
            return
        slot = self.sessions.get(command.session_id)
        if slot is None:
            slot = self.adopt(command.session_id, [])
        if slot.writer is not None:
            self._dead_letter(record, EventError(
                f"session {command.session_id!r} is written by {slot.writer!r} (its events are "
                "published from a dsh session file): the driver does not drive it",
                rule="session-not-driven"))
            return
        if slot.failure is not None or slot.runner is None:
            self._dead_letter(record, EventError(
                f"session {command.session_id!r} cannot take commands: {slot.failure}",
                rule="session-failed"))
            return
        self._submit(slot, record, command)

    def _command_of(self, record: InboxRecord) -> InboxCommand:
        if record.value is None:
            raise CodecError("inbox record has no value (tombstone)")
        command = self.ctx.decode_command(record.value)
        key = record.key.decode("utf-8", "replace") if record.key is not None else None
        if key != command.session_id:
            raise CodecError(f"inbox record key {key!r} differs from the command's session "
                             f"{command.session_id!r}: the key decides the owning partition")
        return command

    def _dead_letter(self, record: InboxRecord, error: DshError) -> None:
        log.warning("inbox %s[%d]@%d to the dead-letter topic: %s", record.topic,
                    record.partition, record.offset, error)
        self.sink.offsets.dead_letter(record.offset)  # committed with the dead letter
        self.sink.add(dead_letter(record, error, self.ctx.settings.max_record_bytes))
        self.ctx.metrics.dead_letters += 1

    def _submit(self, slot: SessionSlot, record: InboxRecord, command: InboxCommand) -> None:
        assert slot.runner is not None
        offsets = self.sink.offsets
        # logged: the command's id enters the log with it (see logged_message_ids)
        logged = isinstance(command, FollowUp | Steer | Inject | Configure | Approve)
        if ((logged and command.message_id in slot.message_ids)
                or (not isinstance(command, FollowUp | Steer | Inject)
                    and offsets.already_applied(command.message_id))):
            self.ctx.metrics.duplicates += 1
            if not logged:
                offsets.applied_control(record.offset, command.message_id)
            offsets.done(record.offset)
            self.sink.wake()
            return
        try:
            slot.runner.submit(command)  # refuses e.g. a configure naming an unknown tool
        except DshError as exc:
            self._dead_letter(record, exc)
            return
        if isinstance(command, FollowUp):
            self._carry_trace(record, command.message_id)
        if logged:
            slot.awaiting[command.message_id] = record.offset
        else:
            offsets.applied_control(record.offset, command.message_id)
        slot.offsets.append(record.offset)
        self.drive(slot)

    def _carry_trace(self, record: InboxRecord, message_id: str) -> None:
        """A caller's valid ``traceparent`` goes with the turn the follow-up starts."""
        raw = header_value(record.headers, HEADER_TRACEPARENT)
        parent = TraceParent.parse(raw.decode("ascii", "replace")) if raw else None
        if parent is not None:
            self.sink.trace_follow_up(message_id, parent.header())

    # -- running sessions ----------------------------------------------------------------

    def drive(self, slot: SessionSlot) -> None:
        """Make sure the session's turn task runs (one task, hence one turn, per session)."""
        if not slot.driving and slot.runner is not None and slot.failure is None:
            slot.task = asyncio.create_task(self._drive(slot), name=f"session-{slot.session_id}")

    async def _drive(self, slot: SessionSlot) -> None:
        assert slot.runner is not None
        taken: list[int] = []
        try:
            while True:
                taken, slot.offsets = slot.offsets, []
                await slot.runner.run_until_idle()
                self._offsets_done(slot, taken)
                if not slot.offsets:
                    self._arm_approval_timer(slot)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a runner bug must not stop the other sessions
            if self.sink.failure is not None:
                return  # the partition is being given up: the next owner carries on
            slot.failure = f"its runner failed: {type(exc).__name__}: {exc}"
            log.exception("session %s in partition %d failed", slot.session_id, self.partition)
            self.ctx.metrics.session_failures += 1
            self._offsets_done(slot, taken + slot.offsets)
            slot.offsets = []

    def _arm_approval_timer(self, slot: SessionSlot, delay_s: float | None = None) -> None:
        """Deny the session's waiting call at its deadline (``--approval-timeout``). The
        deadline is in the log (asked time + timeout): a rebuilt session arms it again."""
        old = self._approval_timers.pop(slot.session_id, None)
        if old is not None:
            old.cancel()
        deadline = slot.runner.approval_deadline if slot.runner is not None else None
        if deadline is None or self.released:
            return
        if delay_s is None:
            delay_s = max(0.0, deadline / 1000 - time.time())
        self._approval_timers[slot.session_id] = asyncio.get_running_loop().call_later(
            delay_s, self._approval_expired, slot)

    def _approval_expired(self, slot: SessionSlot) -> None:
        self._approval_timers.pop(slot.session_id, None)
        if self.released or slot.runner is None or slot.failure is not None:
            return
        if slot.driving:  # its turn runs now: look again once it returned
            self._arm_approval_timer(slot, 0.05)
        elif slot.runner.expire_approval():
            self.drive(slot)
        else:  # not due yet by the runner's clock
            self._arm_approval_timer(slot, 0.05)

    def _offsets_done(self, slot: SessionSlot, offsets: list[int]) -> None:
        for offset in offsets:
            self.sink.offsets.done(offset)
        done = set(offsets)
        for message_id in [m for m, o in slot.awaiting.items() if o in done]:
            del slot.awaiting[message_id]
        self.sink.wake()

    async def release(self, *, grace_s: float, dispose_timeout_s: float = 5.0) -> None:
        """Stop at a safe point: let turns finish within ``grace_s``, commit, close.

        Turns still running after the grace are disposed (``turn/end`` aborted, reason
        ``disposed``) and that is committed, unless the producer is fenced already: then the
        next owner repairs them (``interrupted``). Tasks still alive after that are cancelled.
        """
        if self.released:
            return
        self.released = True
        self.accepting = False
        for timer in self._approval_timers.values():
            timer.cancel()
        tasks = [s.task for s in self.sessions.values() if s.task is not None and not s.task.done()]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        running = [s.runner for s in self.sessions.values() if s.driving and s.runner]
        if running and self.sink.failure is None:
            disposals = [asyncio.create_task(r.dispose()) for r in running]
            await asyncio.wait(disposals + tasks, timeout=dispose_timeout_s,
                               return_when=asyncio.ALL_COMPLETED)
            tasks += disposals
        await cancel_until_done(tasks)  # their outcomes: logged by the sessions themselves
        await self._close_sink()
        self.ctx.metrics.events_committed += self.sink.events_committed
        self.ctx.metrics.transactions += self.producer.transactions_committed
        self.ctx.metrics.transactions_aborted += self.sink.transactions_aborted
        await self.producer.close()


    async def _close_sink(self, timeout_s: float = 30.0) -> None:
        """Commit what is buffered (unless fenced) and stop the flusher; abort if it hangs."""
        task = self.sink_task
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: it is ``sink.failure``, the caller's to report
            return
        self.sink.close()
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        if not done:  # the producer's close() aborts the open transaction
            await cancel_until_done([task])
            return
        with contextlib.suppress(asyncio.CancelledError, DshError):
            await task


CommittedReader = Callable[[], Awaitable[tuple[int | None, str]]]


async def build_partition(ctx: PartitionContext, partition: int,
                          read_committed: CommittedReader) -> OwnedPartition:
    """Fence, rebuild every session of ``partition`` from the session topic, repair, resume.

    The committed inbox offset (and its metadata) is read after fencing: before it, the
    previous owner could still commit a transaction that moves it.
    """
    producer = PartitionProducer(ctx.settings, group_id=ctx.group_id, partition=partition)
    await producer.start()
    owned: OwnedPartition | None = None
    try:
        committed, metadata = await read_committed()
        contents = await read_session_partition(ctx.settings, ctx.settings.topics.session_events,
                                                partition, ctx.decode_event)
        owned = OwnedPartition(ctx, partition, producer, committed or 0, metadata)
        for offset, reason in contents.undecodable:
            log.error("session topic partition %d offset %d is undecodable: %s", partition,
                      offset, reason)
        for session_id, events in contents.events.items():
            writer = contents.writers.get(session_id)
            if writer is None:
                owned.adopt(session_id, events)
            else:
                owned.adopt_written_elsewhere(session_id, writer)
        ctx.metrics.sessions_rebuilt += len(contents.events)
        owned.start_sink()
        await _recover_sessions(owned)
    except BaseException:  # cancelled (the partition left) or failed: nothing runs on
        if owned is not None:
            await owned.release(grace_s=0)  # its sink and the sessions' tasks stop too
        else:
            await producer.close()
        raise
    owned.accepting = True
    ctx.metrics.partitions_built += 1
    return owned


async def _recover_sessions(owned: OwnedPartition) -> None:
    for slot in owned.sessions.values():
        if slot.runner is None:
            continue
        before = slot.log.next_seq
        try:
            await slot.runner.recover()
        except DshError:
            raise  # the sink failed: the whole partition is retried
        except Exception as exc:  # a runner bug must not block the other sessions
            slot.failure = f"its crash repair failed: {type(exc).__name__}: {exc}"
            log.exception("session %s: crash repair failed", slot.session_id)
            owned.ctx.metrics.session_failures += 1
            continue
        if slot.log.next_seq != before:
            owned.ctx.metrics.turns_repaired += 1
        owned.drive(slot)  # continue work the rebuilt inbox lists still hold
