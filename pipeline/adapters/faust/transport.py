"""A faust transport that hands chosen topics to their agents one fetched batch at a time.

faust's per-record cost (a message, an event, the conductor's queues, an ack) is paid once
per fetched batch for the topics named in ``batched_topics`` (the session topic and the
usage-by-model topic): :class:`BatchingConsumer` turns everything one fetch returned for a
partition into ONE faust message (:class:`BatchMessage`) whose ``records`` are the aiokafka
records. Every other topic (changelogs: recovery and standbys) goes through faust
unchanged. faust stays the framework: group membership, changelog tables, standbys, agents,
web routing. The history behind each rule below: docs/decisions/processors-transport.md.

The contract, for batched partitions:

1. *A batch covers a span.* Each batch carries the offsets ``start``..``end`` its fetch
   moved the position over (:mod:`.fetching`), transaction markers and aborted records
   included; a move that handed out no record is a span with nothing to do.
2. *Commit rule.* An offset is committed only when every record below it, from the
   committed offset on, is in a batch whose outputs are acknowledged, whose state is
   written and whose writes are flushed: :func:`.commit_rule.commit_offset`, the one place
   the rule is decided. The folds report a batch done with :func:`mark_folded` (outputs
   acknowledged, state written: each executor's persist, run before every commit in the
   order :mod:`.executor` states); the commit then flushes the producer
   (:class:`.flushing.FlushingProducer`: every buffered write acknowledged, or it raises)
   and only then are those spans flushed. faust's acks and gap bookkeeping play no part.
3. *A refused commit changes nothing:* the committed offsets stay the broker's.
4. *Commits come from faust's commit timer only,* never from the hand-over loop (faust's
   ``broker_commit_every`` is set past reach).
5. *No batch before the seek.* On assignment the batched partitions are paused before
   faust's chain starts; one faust resumes before its recovery seek to the committed
   offsets is done is resumed once it is done (also when the seek fails); a partition with
   no committed offset is read from its beginning. :func:`awaiting_recovery_seek` says
   whether that seek is still pending.
6. *Rebalance steps run while the partitions are paused:* each executor's forget (what
   the folds cached and did not persist is dropped: the new owner folds again from the
   committed offset; on a revoke after its persist) and, on an assignment, its assignment
   step, before faust's own assignment.
7. *A batch lost on the way to the agent is fetched again* (:mod:`.delivery`), and the
   agent reports each batch it takes (:func:`mark_received`).
8. *Every offset is accepted at the hand-over:* faust's read offset is cleared for batched
   partitions (a seek back re-delivers what the folds skip as duplicates by seq).
9. *A recovery seek skips a partition without an offset* (:meth:`BatchingConsumer.seek_wait`):
   one a rebalance added while the recovery awaited the broker; the restarted recovery
   seeks it.
10. *A failed batch is fetched again* (:func:`fetch_again`): its partition is read again from
    its committed offset, after a delay that doubles with each failure in a row (what the
    tables hold comes again and is skipped by seq); nothing of it is folded meanwhile.

Private names of faust and aiokafka are reached through :mod:`.private_api` only, which is
checked when the transport is installed (:func:`use_batching_transport`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Final, Protocol, cast

from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport
from faust.transport.drivers.aiokafka import ensure_aiokafka_TP
from faust.types.tuples import TP, ConsumerMessage

from pipeline.adapters.faust import private_api
from pipeline.adapters.faust.commit_rule import Span, commit_offset
from pipeline.adapters.faust.delivery import DeliveryLedger
from pipeline.adapters.faust.fetching import ShortPollConsumerThread
from pipeline.adapters.faust.flushing import FlushingProducer

log = logging.getLogger(__name__)

# Rule 10: the delay before a failed partition is read again, doubled per failure in a row.
FETCH_AGAIN_DELAY_S: Final = 0.5
FETCH_AGAIN_DELAY_MAX_S: Final = 10.0


class RecordBatch:
    """The records one fetch returned for one partition of a batched topic, and the offsets
    ``start`` (inclusive) to ``end`` (exclusive) they cover (see *What a batch covers*)."""

    __slots__ = ("end", "records", "start")

    def __init__(self, records: Sequence[Any], span: tuple[int | None, int | None]) -> None:
        self.records = records
        first, last = records[0].offset, records[-1].offset
        start, end = span
        # A span that does not contain the records (never seen) falls back to the records.
        self.start = start if start is not None and start <= first else first
        self.end = end if end is not None and end > last else last + 1


class BatchMessage(ConsumerMessage):
    """One faust message standing for a whole :class:`RecordBatch` (value empty); ``span``:
    the offsets it covers (see *What a batch covers*)."""

    __slots__ = ("delivery", "records", "span")

    def __init__(self, *args: Any, records: Sequence[Any], span: tuple[int, int],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records = records
        self.span = span
        self.delivery = -1   # its hand-over number (see DeliveryLedger)


def mark_received(app: Any, message: Any) -> bool:
    """The agent took ``message`` (batches handed over before it and never taken are
    fetched again, :mod:`.delivery`). False: do not fold it, its records come again."""
    consumer = app.consumer
    if isinstance(message, BatchMessage) and isinstance(consumer, BatchingConsumer):
        return consumer.record_received(message)
    return True


def mark_folded(app: Any, event: Any) -> None:
    """Every record of the agent's ``event`` is folded and its table writes are made: its
    span may be committed (a no-op for a plain message). Takes the event, not its message:
    the pending writes keep a batch's event until its mark, and so keep it alive (faust's
    tables find the partition of a write through a weak reference to the current event)."""
    consumer, message = app.consumer, event.message
    if isinstance(message, BatchMessage) and isinstance(consumer, BatchingConsumer):
        consumer.record_folded(message)


def release_records(message: Any) -> None:
    """The agent folded ``message``: its records are not read again, so free them now
    (a batch waiting for :func:`mark_folded` keeps the event and message until the commit:
    a commit's worth of records freed at once would hold the event loop)."""
    if isinstance(message, BatchMessage):
        message.records = ()


class Executor(Protocol):
    """An agent's part of every commit and rebalance (:class:`.executor.BatchExecutor`)."""

    async def persist(self) -> None: ...
    async def forget(self) -> None: ...
    async def assigned(self) -> None: ...


# faust's ``broker_commit_every`` (acks between commits from the hand-over loop): never.
COMMIT_EVERY_ACKS_NEVER: Final = 2**62


def fetch_again(app: Any, topic: str, partition: int) -> int:
    """The folds gave up ``topic[partition]``'s batches since their last persist (folding or
    persisting one failed): read the partition again from its committed offset (rule 10).
    Returns the number of failures of the partition in a row (reset when one of its batches
    is folded); 0 when it is not this worker's (any more), or the topic is not batched."""
    consumer = app.consumer
    if not isinstance(consumer, BatchingConsumer):
        return 0
    return consumer.fetch_again(TP(topic, partition))


def committed_offset(app: Any, topic: str, partition: int) -> int | None:
    """The partition's committed offset as this worker knows it (the next offset to read:
    what it seeked to at assignment, or last committed), None when it has none."""
    consumer = app.consumer
    if not isinstance(consumer, BatchingConsumer):
        return None
    return private_api.committed_offsets(consumer).get(TP(topic, partition))


def awaiting_recovery_seek(app: Any) -> bool:
    """Whether the batched partitions assigned last wait for recovery's seek (*Records
    fetched before the seek*): not consumed yet."""
    consumer = app.consumer
    return isinstance(consumer, BatchingConsumer) and consumer.seek_pending


def table_recovery(app: Any) -> Any:
    """faust's table recovery of ``app`` (its progress counts): the app's table manager is
    faust's ``TableManager``, whose abstract type lacks ``recovery``."""
    return app.tables.recovery


def records_of(message: Any) -> Sequence[Any]:
    """The aiokafka records behind a faust message (one, unless it is a batch)."""
    records: Sequence[Any] | None = getattr(message, "records", None)
    return records if records is not None else (message,)


class BatchingConsumer(AIOKafkaConsumer):
    """faust's aiokafka consumer, delivering batched topics one batch per partition fetch
    (the contract: the module doc)."""

    poll_thread: ShortPollConsumerThread   # built by faust's constructor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spans: dict[Any, set[Span]] = {}   # per batched partition, see commit_rule
        self._ledger = DeliveryLedger()
        self._seeks: set[asyncio.Future[Any]] = set()
        self._failures: dict[Any, int] = {}   # failed batches in a row, per partition (rule 10)
        self.seek_pending = False   # see rule 5 in the module doc
        self._resume_after_seek: set[Any] = set()

    @property
    def _batched(self) -> frozenset[str]:
        return cast(BatchingTransport, self.transport).batched_topics

    @property
    def _executors(self) -> list[Executor]:
        return list(cast(BatchingTransport, self.transport).executors.values())

    def _new_consumer_thread(self) -> Any:
        # faust keeps it too; this reference spares reading faust's private one.
        self.poll_thread = ShortPollConsumerThread(self, loop=self.loop, beacon=self.beacon)
        return self.poll_thread

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        records, active_partitions = await super()._wait_next_records(timeout)
        if not records:
            self._take_moves({})
            return records, active_partitions
        spans = self._take_moves(records)
        regrouped: dict[Any, list[Any]] = {}
        for tp, fetched in records.items():
            batch = tp.topic in self._batched and fetched
            span = spans.get(tp, (None, None))
            regrouped[tp] = [RecordBatch(fetched, span)] if batch else fetched
        return regrouped, active_partitions

    def _take_moves(self, records: Any) -> dict[Any, tuple[int | None, int | None]]:
        """The spans of this fetch's batches, by partition; the moves without records are
        recorded as spans with nothing to do."""
        thread = self.poll_thread
        moves, thread.moves = thread.moves, []
        spans: dict[Any, tuple[int | None, int | None]] = {}
        for tp, start, end in moves:
            if tp.topic not in self._batched:
                continue
            if records.get(tp):
                known = spans.get(tp)
                spans[tp] = (start, end) if known is None else (known[0], end)
            else:
                self._spans.setdefault(tp, set()).add(Span.without_records(start, end))
        return spans

    async def perform_seek(self) -> None:
        """Seek to the committed offsets, and a batched partition without one to its
        beginning; then resume the batched partitions held back meanwhile (rule 5)."""
        try:
            await super().perform_seek()
            committed = private_api.committed_offsets(self)
            uncommitted = [tp for tp in self.assignment()
                           if tp.topic in self._batched and not committed[tp]]
            if uncommitted:
                thread = self.poll_thread
                await thread.seek_to_beginning(*map(ensure_aiokafka_TP, uncommitted))
        finally:   # also when the seek failed or timed out: never paused for good
            self.seek_pending = False
            resume, self._resume_after_seek = self._resume_after_seek, set()
            super().resume_partitions(resume & set(self.assignment()))

    async def seek_wait(self, partitions: Any) -> None:
        """Seek changelog partitions for faust's table recovery, those with an offset only.

        The recovery seeks every partition of its active (or standby) set to the offset it
        read for it from the broker; a rebalance while it awaited the broker refills that
        set, with no offset (None) for a partition it adds, and restarts the recovery, which
        seeks that partition then. aiokafka refuses a None offset (``ValueError: Offset must
        be a positive integer``), which crashed the worker (rule 9)."""
        sought = {tp: offset for tp, offset in partitions.items() if offset is not None}
        if len(sought) < len(partitions):
            log.info("recovery seek of %d partitions without an offset left to the restarted "
                     "recovery (a rebalance came meanwhile)", len(partitions) - len(sought))
        if sought:
            await super().seek_wait(sought)

    def resume_partitions(self, tps: Any) -> None:
        if self.seek_pending:   # rule 5
            held = {tp for tp in tps if tp.topic in self._batched}
            self._resume_after_seek |= held
            tps = [tp for tp in tps if tp not in held]
        super().resume_partitions(tps)

    async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
        if tp.topic not in self._batched:
            await super()._add_gap(tp, offset_from, offset_to)

    def record_received(self, message: Any) -> bool:
        """The agent took ``message``: batches handed over before it and never taken are
        fetched again (:mod:`.delivery`). A batch of an earlier generation changes nothing
        (its partition's commits start again from the broker's). Returns whether to fold
        it (:meth:`.delivery.DeliveryLedger.admits`)."""
        if message.generation_id != self.app.consumer_generation_id:
            return True
        start = message.span[0] if message.span[0] is not None else message.records[0].offset
        rewind = self._ledger.taken(message.topic, message.tp, message.offset,
                                    message.delivery, start)
        thread = self.poll_thread
        for tp, start in rewind.items():
            log.warning("records of %s[%d] from offset %d were fetched but never reached "
                        "the agent; fetching them again", tp.topic, tp.partition, start)
            self._seeks.add(asyncio.ensure_future(
                thread.seek_wait({ensure_aiokafka_TP(tp): start})))
        self._seeks = {seek for seek in self._seeks if not seek.done()}
        return self._ledger.admits(message.tp, start)

    def record_folded(self, message: Any) -> None:
        """``message``'s outputs are acknowledged and its state written: its span is
        committed once the commit's flush is done (two deliveries of the same records, both
        folded, cover the union of their spans)."""
        if message.generation_id == self.app.consumer_generation_id:
            self._failures.pop(message.tp, None)
            start, end = message.span
            self._spans.setdefault(message.tp, set()).add(
                Span(start, end, outputs_acknowledged=True, state_written=True))

    def fetch_again(self, tp: Any) -> int:
        """Rule 10 (see :func:`fetch_again`)."""
        if tp.topic not in self._batched or tp not in self.assignment():
            return 0
        failures = self._failures[tp] = self._failures.get(tp, 0) + 1
        self._ledger.hold(tp)
        delay = min(FETCH_AGAIN_DELAY_S * 2 ** (failures - 1), FETCH_AGAIN_DELAY_MAX_S)
        self._seeks.add(asyncio.ensure_future(
            self._read_again(tp, self.app.consumer_generation_id, delay)))
        return failures

    async def _read_again(self, tp: Any, generation: int, delay: float) -> None:
        """Seek ``tp`` to its committed offset (its first offset when it has none) after
        ``delay``; tried again until it is done or the partition is reassigned (a rebalance
        reads every partition again from its committed offset anyway)."""
        while True:
            await asyncio.sleep(delay)
            if generation != self.app.consumer_generation_id:
                return
            try:
                # Not below the first offset (retention may have deleted past the commit:
                # the ledger waits for a batch starting at or before this offset).
                first = (await self.earliest_offsets(tp))[tp]
                offset = max(private_api.committed_offsets(self).get(tp) or 0, first)
                self._ledger.fetch_again_from(tp, offset)
                await self.poll_thread.seek_wait({ensure_aiokafka_TP(tp): offset})
            except Exception as exc:   # the broker may be the reason the batch failed
                log.warning("reading %s[%d] again failed (%s: %s); trying again", tp.topic,
                            tp.partition, type(exc).__name__, exc)
                delay = FETCH_AGAIN_DELAY_MAX_S
                continue
            log.warning("%s[%d] is read again from offset %d (a batch of it failed)",
                        tp.topic, tp.partition, offset)
            return

    async def _persist(self) -> None:
        for executor in self._executors:
            try:
                await executor.persist()
            except Exception:   # its batches stay uncommitted; the commit goes on
                log.exception("persisting %s before the commit failed", executor)

    async def force_commit(self, topics: Any = None, start_new_transaction: bool = True
                           ) -> bool:
        await self._persist()   # reports the batches this commit may cover (rule 2)
        await self._flush_spans()
        did_commit: bool = await super().force_commit(
            topics, start_new_transaction=start_new_transaction)
        return did_commit

    async def _flush_spans(self) -> None:
        """Flush the producer (raises on a write that failed: nothing is committed past
        it); the spans reported before the flush are flushed."""
        reported = {tp: [span for span in spans if not span.flushed]
                    for tp, spans in self._spans.items()}
        await self.app.producer.flush()
        for tp, spans in reported.items():
            live = self._spans.get(tp)
            if live is None:
                continue
            for span in spans:
                if span in live:
                    live.discard(span)
                    live.add(replace(span, flushed=True))

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._persist()   # before faust's revoke: the tables still take writes
        for executor in self._executors:
            await executor.forget()
        await super().on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any, generation_id: int = 0) -> None:
        # Paused from the start (rule 5); faust pauses them too, a few awaits later, and
        # its recovery resumes them.
        self.pause_partitions({tp for tp in assigned if tp.topic in self._batched})
        # Recovery seeks when anything is assigned (a new rebalance starts this again).
        self.seek_pending = any(tp.topic in self._batched for tp in assigned)
        self._resume_after_seek = set()
        for tp in assigned:   # acked and folded by the previous generation
            if tp.topic in self._batched:
                private_api.forget_acks(self, tp)
                self._spans.pop(tp, None)
        self._ledger.forget()
        for executor in self._executors:   # rule 6
            await executor.forget()
        for executor in self._executors:
            await executor.assigned()
        await super().on_partitions_assigned(assigned, generation_id)

    def _new_offset(self, tp: Any) -> int | None:
        """For a batched partition: :func:`.commit_rule.commit_offset`. The spans stay until
        a commit past them succeeded (:meth:`_commit_offsets`): a refused commit is tried
        again."""
        if tp.topic not in self._batched:
            result: int | None = super()._new_offset(tp)
            return result
        spans = self._spans.setdefault(tp, set())
        committed = private_api.committed_offsets(self)[tp]
        if committed is not None:
            private_api.forget_acks_below(self, tp, committed)
            spans.difference_update({span for span in spans if span.end <= committed})
        return commit_offset(spans, committed)

    async def _commit_offsets(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        """faust's commit, except that a commit the broker refused leaves the committed
        offsets of batched partitions as they were (rule 3: faust records them as committed
        whether or not the broker took them)."""
        committed = private_api.committed_offsets(self)
        before = {tp: committed[tp] for tp in offsets if tp.topic in self._batched}
        did_commit: bool = await super()._commit_offsets(
            offsets, start_new_transaction=start_new_transaction)
        if not did_commit:
            committed.update(before)
        return did_commit

    def _to_message(self, tp: Any, record: Any) -> Any:
        """A batch's one faust message (rule 8: faust checks its read offset after this,
        and every offset is accepted)."""
        if not isinstance(record, RecordBatch):
            return super()._to_message(tp, record)
        private_api.clear_read_offset(self, tp)
        last = record.records[-1]
        timestamp = last.timestamp / 1000.0 if last.timestamp is not None else None
        message = BatchMessage(last.topic, last.partition, last.offset, timestamp,
                               last.timestamp_type, None, None, b"", None, 0, 0, tp,
                               generation_id=self.app.consumer_generation_id,
                               records=record.records, span=(record.start, record.end))
        message.delivery = self._ledger.handed_over(tp.topic, tp, last.offset, record.start)
        return message


class BatchingTransport(AIOKafkaTransport):
    """faust's aiokafka transport with :class:`BatchingConsumer` and
    :class:`FlushingProducer`."""

    Consumer = BatchingConsumer
    Producer = FlushingProducer

    def __init__(self, url: Any, app: Any, batched_topics: Iterable[str] = (),
                 fetch_max_wait_ms: int = 1500, fetch_min_bytes: int = 1, **kwargs: Any
                 ) -> None:
        super().__init__(url, app, **kwargs)
        self.batched_topics = frozenset(batched_topics)
        self.executors: dict[str, Executor] = {}   # by topic, installed with the app
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_min_bytes = fetch_min_bytes


def use_batching_transport(app: Any, batched_topics: Iterable[str], *,
                           fetch_max_wait_ms: int, fetch_min_bytes: int = 1) -> None:
    """Make ``app`` consume ``batched_topics`` in batches (call before declaring topics);
    the fetch options are the consumer's (see :class:`.options.ProcessorsOptions`)."""
    if getattr(app, "_transport", None) is not None:
        raise RuntimeError("the faust transport already exists: install batching first")
    private_api.require_supported_faust()
    # Rule 4: faust's commit every ``broker_commit_every`` acks runs inside the hand-over
    # loop; set past reach, only its commit timer commits.
    app.conf.broker_commit_every = COMMIT_EVERY_ACKS_NEVER
    app.transport = BatchingTransport(app.conf.broker_consumer, app, batched_topics,
                                      fetch_max_wait_ms, fetch_min_bytes)
