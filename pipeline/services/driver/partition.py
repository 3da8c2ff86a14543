"""One owned inbox partition: its producer, its sink, its sessions and their runners.

Built on assignment (``takeover.build_partition``): start the transactional producer of
the partition (this fences any older owner and aborts its open transaction), read the bounded
tail of the session partition its inbox commit names (after a crash mid-turn) and the same
partition of the checkpoint topic (one record per session, ``checkpointing.py``), keep its
index, load the sessions that are busy (a turn open, or waking inbox work) or have newer
events in the tail, let each repair an open turn (``runner.recover()``) and continue pending
work. Inbox commands are then
dispatched to the session's runner; each session's turns run in one task, off the poll loop.

Memory holds the sessions at work, not every session ever seen: a session whose last command
and turn are ``idle_evict_s`` behind it is evicted once its last events are committed (its
checkpoint then holds everything), and its next command loads it back from its checkpoint
(one record, read at the offset the index holds); commands that arrive while it loads wait,
in order, with their inbox offsets uncommitted. A session waiting for a person's approval is
evicted too: its deadline stays armed, and a decision or the deadline loads it.

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
from collections.abc import Awaitable

from pipeline.adapters.cancelling import cancel_until_done
from pipeline.adapters.kafka.checkpoints import CheckpointEntry
from pipeline.adapters.kafka.dlq import dead_letter
from pipeline.adapters.kafka.records import (
    InboxRecord,
    header_value,
    inbox_record_limit,
    record_bytes,
)
from pipeline.adapters.kafka.transactional import PartitionProducer
from pipeline.codec.records import HEADER_TENANT, HEADER_TRACEPARENT
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.core.errors import BrokerError, CodecError, DshError, EventError
from pipeline.core.genai_trace import TraceParent
from pipeline.core.inbox import (
    Approve,
    Configure,
    FollowUp,
    InboxCommand,
    Inject,
    Steer,
    with_tenant,
)
from pipeline.core.log import SessionLog
from pipeline.services.driver.checkpointing import invalid_log_reason
from pipeline.services.driver.inbox_offsets import (
    InboxOffsets,
    applied_from_metadata,
    dead_lettered_from_metadata,
    tail_from_metadata,
)
from pipeline.services.driver.kafka_sink import PartitionSink
from pipeline.services.driver.slots import (
    CommandDecoder,
    DriverMetrics,
    PartitionContext,
    RunnerFactory,
    SessionRunnerLike,
    SessionSlot,
)

__all__ = ["CommandDecoder", "DriverMetrics", "OwnedPartition", "PartitionContext",
           "RunnerFactory", "SessionRunnerLike", "SessionSlot"]

log = logging.getLogger(__name__)


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
                                                       metadata=metadata,
                                                       tail=tail_from_metadata(metadata)),
                                  on_logged=self._on_logged, linger_ms=ctx.linger_ms,
                                  wait_for_commit=not ctx.pipelined_flush,
                                  max_record_bytes=ctx.settings.max_record_bytes,
                                  steps_per_transaction=ctx.steps_per_transaction,
                                  checkpoints_topic=topics.driver_checkpoints,
                                  on_checkpointed=self._on_checkpointed)
        self.sink_task: asyncio.Task[None] | None = None
        self._approval_timers: dict[str, asyncio.TimerHandle] = {}
        self.index: dict[str, CheckpointEntry] = {}  # every session of the partition
        self._loading: dict[str, list[tuple[InboxRecord, InboxCommand]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # loads and the eviction sweep
        self.accepting = False
        self.released = False

    @property
    def turns_in_flight(self) -> int:
        return sum(1 for slot in self.sessions.values() if slot.driving)

    def start_sink(self) -> None:
        self.sink_task = asyncio.create_task(self.sink.run(), name=f"sink-p{self.partition}")

    def adopt(self, checkpoint: SessionCheckpoint) -> SessionSlot:
        """A slot for a session restored from its checkpoint (no runner if another writer
        writes it); the sink folds its next events into ``checkpoint``."""
        session_id = checkpoint.session_id
        if checkpoint.writer is not None:
            slot = SessionSlot(session_id, SessionLog(session_id, bounded=True), None,
                               writer=checkpoint.writer)
            self.sessions[session_id] = slot
            return slot
        try:
            log_, history = checkpoint.restore(mode=self.ctx.rebuild_mode)
        except DshError as exc:  # it fails alone: its commands are dead-lettered
            log.error("session %s: its checkpoint does not restore: %s", session_id, exc)
            return self.fail(session_id, f"its checkpoint does not restore: {exc}")
        slot = SessionSlot(session_id, log_, None)
        slot.message_ids.update(history.message_ids, history.configure_ids,
                                history.approvals.message_ids)
        slot.runner = self.ctx.runner_factory(log_, self.sink, history)
        self.sink.track(checkpoint)
        self.sessions[session_id] = slot
        return slot

    def fail(self, session_id: str, failure: str) -> SessionSlot:
        """A slot for a session that cannot be driven: its commands are dead-lettered."""
        slot = SessionSlot(session_id, SessionLog(session_id, bounded=True), None,
                           failure=failure)
        self.sessions[session_id] = slot
        return slot

    def _on_checkpointed(self, session_id: str, entry: CheckpointEntry) -> None:
        self.index[session_id] = entry

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
        self._dispatch(record, command)

    def _dispatch(self, record: InboxRecord, command: InboxCommand) -> None:
        session_id = command.session_id
        queued = self._loading.get(session_id)
        if queued is not None:  # it is being loaded: in order, after the load
            queued.append((record, command))
            return
        slot = self.sessions.get(session_id)
        if slot is None:
            entry = self.index.get(session_id)
            if entry is not None and entry.writer is None:
                self._load(session_id, entry, [(record, command)])
                return
            writer = entry.writer if entry is not None else None
            slot = self.adopt(SessionCheckpoint(session_id, writer=writer))
        if slot.writer is not None:
            self._not_driven(record, session_id, slot.writer)
            return
        if slot.failure is not None or slot.runner is None:
            self._dead_letter(record, EventError(
                f"session {session_id!r} cannot take commands: {slot.failure}",
                rule="session-failed"))
            return
        slot.last_active = time.monotonic()
        self._submit(slot, record, command)

    def _not_driven(self, record: InboxRecord, session_id: str, writer: str) -> None:
        reason = invalid_log_reason(writer)
        if reason is not None:
            self._dead_letter(record, EventError(
                f"session {session_id!r} cannot take commands: {reason}",
                rule="session-failed"))
            return
        self._dead_letter(record, EventError(
            f"session {session_id!r} is written by {writer!r} (its events are published from a "
            "dsh session file): the driver does not drive it", rule="session-not-driven"))

    # -- leaving memory and coming back ----------------------------------------------------

    def _load(self, session_id: str, entry: CheckpointEntry,
              queued: list[tuple[InboxRecord, InboxCommand]]) -> None:
        """Load an evicted session from its checkpoint, then dispatch what waited for it."""
        self._loading[session_id] = queued
        self._spawn(self._load_and_dispatch(session_id, entry), f"load-{session_id}")

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load_and_dispatch(self, session_id: str, entry: CheckpointEntry) -> None:
        try:
            checkpoint = await self._load_checkpoint(session_id, entry)
        except DshError as exc:  # a checkpoint that does not decode: the session fails alone
            log.error("session %s: its checkpoint does not load: %s", session_id, exc)
            checkpoint = None
            failure = f"its checkpoint does not load: {exc}"
        if self.released:
            return
        slot = self.fail(session_id, failure) if checkpoint is None else self.adopt(checkpoint)
        self.ctx.metrics.sessions_loaded += 1
        if slot.runner is not None:
            await slot.runner.recover()  # an evicted session is idle: normally nothing to do
        for record, command in self._loading.pop(session_id, []):
            self._dispatch(record, command)
        if not slot.driving:
            self._arm_approval_timer(slot)

    async def _load_checkpoint(self, session_id: str, entry: CheckpointEntry
                               ) -> SessionCheckpoint:
        """Retried while the broker fails: the waiting commands' offsets stay uncommitted."""
        while True:
            try:
                return await self.ctx.checkpoints.load(self.partition, session_id, entry)
            except BrokerError as exc:
                log.warning("session %s: loading its checkpoint failed (%s); retrying",
                            session_id, exc)
                await asyncio.sleep(self.ctx.load_retry_s)

    def start_evicting(self) -> None:
        """Sweep idle sessions out of memory, every quarter of the idle time (at most 30 s)."""
        self._spawn(self._evict_forever(), f"evict-p{self.partition}")

    async def _evict_forever(self) -> None:
        period = min(30.0, self.ctx.evict_after_s / 4)
        while not self.released:
            await asyncio.sleep(period)
            self.evict_idle(time.monotonic() - self.ctx.evict_after_s)

    def evict_idle(self, active_before: float) -> int:
        """Evict the sessions last active before ``active_before`` whose events are all
        committed; returns how many left memory."""
        evicted = 0
        for session_id, slot in list(self.sessions.items()):
            if (slot.last_active >= active_before or slot.driving or slot.offsets
                    or slot.awaiting or slot.failure is not None
                    or not self.sink.forget(session_id)):
                continue
            deadline = slot.runner.approval_deadline if slot.runner is not None else None
            timer = self._approval_timers.pop(session_id, None)
            if timer is not None:
                timer.cancel()
            del self.sessions[session_id]
            if deadline is not None:  # the deadline loads it back
                self._approval_timers[session_id] = asyncio.get_running_loop().call_later(
                    max(0.0, deadline / 1000 - time.time()), self._deadline_wake, session_id)
            evicted += 1
        self.ctx.metrics.sessions_evicted += evicted
        return evicted

    def _deadline_wake(self, session_id: str) -> None:
        self._approval_timers.pop(session_id, None)
        entry = self.index.get(session_id)
        if self.released or session_id in self.sessions or session_id in self._loading \
                or entry is None:
            return
        self._load(session_id, entry, [])

    def _command_of(self, record: InboxRecord) -> InboxCommand:
        if record.value is None:
            raise CodecError("inbox record has no value (tombstone)")
        command = self.ctx.decode_command(record.value)
        key = record.key.decode("utf-8", "replace") if record.key is not None else None
        if key != command.session_id:
            raise CodecError(f"inbox record key {key!r} differs from the command's session "
                             f"{command.session_id!r}: the key decides the owning partition")
        tenant = header_value(record.headers, HEADER_TENANT)
        if tenant is not None:
            return with_tenant(command, tenant.decode("utf-8", "replace"))
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
                slot.last_active = time.monotonic()
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
        if self.released or slot.runner is None or slot.failure is not None \
                or self.sessions.get(slot.session_id) is not slot:  # evicted meanwhile
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
        await cancel_until_done(list(self._tasks))  # loads and the sweep
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
        self.ctx.metrics.checkpoints_written += self.sink.plan.written
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
