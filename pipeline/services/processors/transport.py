"""A faust transport that hands chosen topics to their agents one fetched batch at a time.

faust turns every consumed record into a message, an event, a trip through the conductor's
queues and an ack: about 130 us of CPU per record on the project's machine, which alone caps
a worker near 7,700 records per CPU-second. Most session records are ``assistant/chunk`` and
change no table, and the rest are folded by pure code that costs far less than that. So for
the topics named in ``batched_topics`` (the session topic and the usage-by-model topic),
:class:`BatchingConsumer` turns everything one fetch returned for a partition into ONE faust
message whose ``records`` are the aiokafka records (offset = the batch's last offset); every
other topic (changelogs: recovery and standbys) goes through faust unchanged, record by
record. Table writes made while folding a batch go to the changelog partition of the batch's
partition, as faust does for any event.

**Offsets.** faust commits, per partition, the end of the run of consecutive offsets it has
seen acked, where "seen" includes offset *gaps* it recorded with ``_add_gap``. For batches
that bookkeeping is both wrong and slow: it records a gap only between two delivered
messages and not at all after a message at offset 0 (its check is ``if gap > 1 and
r_offset``), so a partition whose first fetch held offset 0 alone would never commit again
and every restart would re-deliver everything; and it rebuilds an interval tree per gap,
which grows by one interval per batch until the next commit. A batched partition's messages
are processed strictly in order by its one agent and each one stands for every offset of its
fetch, so the consumer keeps no gaps for them and commits past the run of acked batches that
starts at the committed offset (:func:`committable`).

*What a batch covers.* Between two fetches of a partition lie offsets no record stands for:
transaction markers (every driver transaction ends with one) and, reading committed only,
aborted records; a batch's first and last records do not say where its fetch started and
ended. aiokafka hands a partition's records out from its position, and moves the position
past what it handed out (trailing markers included), synchronously; the consumer thread
(:class:`ShortPollConsumerThread`) reads the position right before and right after, so each
batch carries the exact *span* of offsets it covers, and "every data record in the span was
folded" is true of a folded batch whatever seeks and rebalances happened around it. A drain
that moved a position without handing out a record (a marker alone) is a span folded
already. The commit is the end of the run of folded spans that starts at the committed
offset (:func:`committable`). Taking the first *record* as a batch's start instead stalls
the commit for good at the first batch that follows a marker.

*Only folded batches commit.* Depending on the stream iterator (faust's Cython one inlines
the consumer's ack bookkeeping, so no consumer override sees the acks), faust counts as
acked a message its stream *skipped*, or only those its agent finished. So an ack alone
says nothing: a batch is recorded once it is folded completely and its table writes are
made (:func:`mark_folded`; the session folds make them right before each commit, through
:func:`persist_before_commit`), and only recorded spans are committable. A batch whose
folding failed is never recorded, so the commit stops before it and the records are fetched
again after the next seek to the committed offset.

*Records fetched for a paused partition.* faust asks aiokafka for the records of its
*active* partitions, a live set, and drops what a fetch returned for a partition that is
no longer in it when the records are handed over, after aiokafka moved the partition's
position past them. On assignment faust first makes every assigned partition active and
pauses them only a few awaits later, until table recovery is done; a fetch in between
returns records that are dropped, and for a partition with no committed offset the seek
after recovery leaves the position where it is: those records are never folded (every
session in them stops at a gap). Worse, aiokafka hands out every partition's records when
the set it is asked for is *empty*, as it is while all are paused (changelog partitions
included). So aiokafka is asked through :class:`AskedPartitions`, never empty; batched
partitions are paused before faust's assignment starts; and the seek after recovery puts a
batched partition without a committed offset at its beginning.

*Records fetched before the seek.* faust's recovery resumes the stream partitions, with
the flow already running, and only then seeks them to the committed offsets. Records handed
out in between (aiokafka starts at the committed offset too) were folded, and the seek
fetched them again: folded twice (skipped as duplicates, but fetched and counted twice;
measured at a restart: 106 records, in 4 runs of 4 once the assignment awaited a pointer
read), or dropped on the way and taken for lost (a needless rewind). A batched partition
resumed between its assignment and the end of that seek is resumed when the seek is done.

*Faust's read offset.* faust drops a fetched message whose offset is below the partition's
"read offset", which its fetch loop sets *after* handing a message over; when that hand-over
spans a rebalance, the value it writes is the last offset of a batch of the previous
generation, written over the committed offset the rebalance had seeked to, and the batches
fetched again from there are dropped: the records between the commit and that offset are
never folded. For batched topics the read offset is cleared before each hand-over (aiokafka
already never returns a record twice within one position run; a seek back re-delivers what
the folds skip as duplicates by seq).

*Forgetting on a rebalance.* What the folds cached in memory and did not persist is
dropped at every rebalance (:func:`forget_on_rebalance`): the new owner of a partition folds
it again from the committed offset. It must be dropped at the start of the assignment, while
every batched partition is still paused. faust's ``on_partitions_assigned`` *signal* comes
too late: it is sent after the table recovery is started, and a short recovery has resumed
the partitions and their first batches are folded by then (measured on the scale-out run, a
survivor taking over 6 partitions: the signal came 0.8 s after "Worker ready" and dropped
the 12 batches folded meanwhile, which were never fetched again: the taken-over sessions
stayed unfolded and the partitions' commits never moved; about 1 run in 3 failed so). The
same goes for anything else a worker must do before it folds newly assigned partitions
(:func:`before_assignment`: re-reading the projection pointer, so that a handover pending
meanwhile holds them from their first record).

**Durable before committed.** faust's commit calls ``producer.flush()`` first, but faust's
flush can return with writes still unsent: its buffer drain gives up after 0.1 s without a
send (``ProducerBuffer.flush_atmost``), and a write the buffer task took off the queue is not
yet in aiokafka's batches when aiokafka's flush looks. A kill -9 right after such a commit
loses table writes (changelogs) that the committed offset claims: a recovered table behind
its partition's commit, reported as a gap and never folded past. :class:`FlushingProducer`
tracks every write put in its buffer and its ``flush`` returns only when all of them are
acknowledged by the broker (acks=all), or raises, so nothing is committed past a lost write.

The app gets it with :func:`use_batching_transport` before any topic, table or agent exists.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Final, cast

from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Transport as AIOKafkaTransport
from faust.transport.drivers.aiokafka import ensure_aiokafka_TP
from faust.types.tuples import ConsumerMessage

from pipeline.services.processors.delivery import DeliveryLedger
from pipeline.services.processors.fetching import AskedPartitions, ShortPollConsumerThread
from pipeline.services.processors.flushing import FlushingProducer

log = logging.getLogger(__name__)


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
    span may be committed (a no-op for a plain message). Takes the event, not its message,
    so that a callback waiting to call this keeps the event alive (faust's tables find the
    partition of a write through a weak reference to the current event)."""
    consumer, message = app.consumer, event.message
    if isinstance(message, BatchMessage) and isinstance(consumer, BatchingConsumer):
        consumer.record_folded(message)


def release_records(message: Any) -> None:
    """The agent folded ``message``: its records are not read again, so free them now.
    The batch's "folded" mark keeps its event (and so this message) until the next commit
    (:mod:`.persisting`); a commit's worth of records freed at once held the event loop
    for ~10 ms at 5,000 events/s, in the middle of the persist."""
    if isinstance(message, BatchMessage):
        message.records = ()


# Work the folds hand the consumer for one of its moments (see :class:`BatchingConsumer`).
Hook = Callable[[], Awaitable[None]]
BEFORE_COMMIT: Final = "before commit"   # and before partitions are revoked
ON_REBALANCE: Final = "on rebalance"     # revoke (after the persist), assignment (first)
BEFORE_ASSIGNMENT: Final = "before assignment"


def persist_before_commit(app: Any, name: str, persist: Hook) -> None:
    """Run ``persist`` before every commit and before partitions are revoked (the folds
    write their tables there, :mod:`.persisting`); ``name`` makes it idempotent."""
    _add_hook(app, BEFORE_COMMIT, name, persist)


def forget_on_rebalance(app: Any, name: str, forget: Hook) -> None:
    """Run ``forget`` when partitions are revoked (after the persist) and when new ones are
    assigned, before any of them can be fetched (see *Forgetting on a rebalance*);
    ``name`` makes it idempotent."""
    _add_hook(app, ON_REBALANCE, name, forget)


def before_assignment(app: Any, name: str, prepare: Hook) -> None:
    """Run ``prepare`` when partitions are assigned, after the forgetting and before any of
    them can be fetched (where faust's ``on_partitions_assigned`` signal is too late, see
    *Forgetting on a rebalance*); ``name`` makes it idempotent."""
    _add_hook(app, BEFORE_ASSIGNMENT, name, prepare)


def _add_hook(app: Any, moment: str, name: str, hook: Hook) -> None:
    consumer = app.consumer
    if isinstance(consumer, BatchingConsumer):
        consumer.hooks[moment][name] = hook


def awaiting_recovery_seek(app: Any) -> bool:
    """Whether the batched partitions assigned last wait for recovery's seek (*Records
    fetched before the seek*): not consumed yet."""
    consumer = app.consumer
    return isinstance(consumer, BatchingConsumer) and consumer.seek_pending


def records_of(message: Any) -> Sequence[Any]:
    """The aiokafka records behind a faust message (one, unless it is a batch)."""
    records: Sequence[Any] | None = getattr(message, "records", None)
    return records if records is not None else (message,)


def committable(spans: Iterable[tuple[int, int]], committed: int | None) -> int | None:
    """The offset to commit, or None when it does not move.

    ``spans``: the ``(start, end)`` offset ranges whose data records are all folded (the
    batches the agent folded, and the ranges aiokafka skipped without a record: markers,
    aborted records); ``committed``: the committed offset (the next to read), None before
    the first commit. The end of the run of spans that starts at ``committed`` and has no
    hole is committable: a batch not folded (skipped, lost on the way, failed) leaves a hole,
    so nothing after it is committed.
    """
    position, moved = committed, False
    for start, end in sorted(spans):
        if position is not None and start > position:
            break
        if position is None or end > position:
            position, moved = end, True
    return position if moved else None


class BatchingConsumer(AIOKafkaConsumer):
    """faust's aiokafka consumer, delivering batched topics one batch per partition fetch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_spans: dict[Any, set[tuple[int, int]]] = {}   # folded, see committable
        self._ledger = DeliveryLedger()
        self._seeks: set[asyncio.Future[Any]] = set()
        self._refused: dict[Any, int | None] = {}   # see _commit_offsets
        self.seek_pending = False   # see *Records fetched before the seek*
        self._resume_after_seek: set[Any] = set()
        self.hooks: dict[str, dict[str, Hook]] = {
            moment: {} for moment in (BEFORE_COMMIT, ON_REBALANCE, BEFORE_ASSIGNMENT)}
        # Commits come from faust's commit timer only. Its other trigger, every
        # ``broker_commit_every`` acks, commits INSIDE the loop that hands fetched records
        # to the agents, so every partition waited for the whole commit (the persist, the
        # producer flush, the offset commit: 30-80 ms measured at 5,000 events/s), about
        # every 20 s at that rate and more often the faster records come.
        self._commit_every = None

    def _new_consumer_thread(self) -> Any:
        return ShortPollConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        records, active_partitions = await super()._wait_next_records(timeout)
        if not records:
            self._take_moves({})
            return records, active_partitions
        batched: frozenset[str] = cast(BatchingTransport, self.transport).batched_topics
        spans = self._take_moves(records)
        regrouped: dict[Any, list[Any]] = {}
        for tp, fetched in records.items():
            batch = tp.topic in batched and fetched
            span = spans.get(tp, (None, None))
            regrouped[tp] = [RecordBatch(fetched, span)] if batch else fetched
        return regrouped, active_partitions

    def _take_moves(self, records: Any) -> dict[Any, tuple[int | None, int | None]]:
        """The spans of this fetch's batches, by partition; the moves without records are
        folded already (nothing to fold) and recorded so."""
        thread = cast(ShortPollConsumerThread, self._thread)
        moves, thread.moves = thread.moves, []
        batched = cast(BatchingTransport, self.transport).batched_topics
        spans: dict[Any, tuple[int | None, int | None]] = {}
        for tp, start, end in moves:
            if tp.topic not in batched:
                continue
            if records.get(tp):
                known = spans.get(tp)
                spans[tp] = (start, end) if known is None else (known[0], end)
            else:
                self._batch_spans.setdefault(tp, set()).add((start, end))
        return spans

    async def getmany(self, timeout: float) -> Any:
        batched = cast(BatchingTransport, self.transport).batched_topics
        read_offset = self._read_offset
        async for tp, message in super().getmany(timeout):
            if tp.topic in batched:
                read_offset[tp] = None   # see *Faust's read offset* in the module doc
            yield tp, message

    async def _getmany(self, active_partitions: Any, timeout: float) -> Any:
        partitions = None if active_partitions is None else AskedPartitions(active_partitions)
        return await super()._getmany(cast(Any, partitions), timeout)

    async def perform_seek(self) -> None:
        """Seek to the committed offsets, and a batched partition without one to its
        beginning: aiokafka's seek leaves such a partition where it is, past any records
        fetched before and dropped (see *Records fetched for a paused partition*). Then
        the batched partitions resumed meanwhile are resumed (*Records fetched before the
        seek*)."""
        try:
            await super().perform_seek()
            batched = cast(BatchingTransport, self.transport).batched_topics
            uncommitted = [tp for tp in self.assignment()
                           if tp.topic in batched and not self._committed_offset[tp]]
            if uncommitted:
                await self._thread.seek_to_beginning(*map(ensure_aiokafka_TP, uncommitted))
        finally:   # also when the seek failed or timed out: never paused for good
            self.seek_pending = False
            resume, self._resume_after_seek = self._resume_after_seek, set()
            super().resume_partitions(resume & set(self.assignment()))

    def resume_partitions(self, tps: Any) -> None:
        if self.seek_pending:   # see *Records fetched before the seek*
            batched = cast(BatchingTransport, self.transport).batched_topics
            held = {tp for tp in tps if tp.topic in batched}
            self._resume_after_seek |= held
            tps = [tp for tp in tps if tp not in held]
        super().resume_partitions(tps)

    async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
        if tp.topic not in cast(BatchingTransport, self.transport).batched_topics:
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
        for tp, start in rewind.items():
            log.warning("records of %s[%d] from offset %d were fetched but never reached "
                        "the agent; fetching them again", tp.topic, tp.partition, start)
            self._seeks.add(asyncio.ensure_future(
                self._thread.seek_wait({ensure_aiokafka_TP(tp): start})))
        self._seeks = {seek for seek in self._seeks if not seek.done()}
        return self._ledger.admits(message.tp, start)

    def record_folded(self, message: Any) -> None:
        """``message`` is folded: its span becomes committable once faust counts its ack;
        two deliveries of the same records (a seek back), both folded, cover the union of
        their spans."""
        if message.generation_id == self.app.consumer_generation_id:
            self._record_span(message)

    async def _persist(self) -> None:
        for name, persist in list(self.hooks[BEFORE_COMMIT].items()):
            try:
                await persist()
            except Exception:   # its batches stay uncommitted; the commit goes on
                log.exception("persisting %s before the commit failed", name)

    async def force_commit(self, topics: Any = None, start_new_transaction: bool = True
                           ) -> bool:
        await self._persist()   # records the spans this commit may cover
        did_commit: bool = await super().force_commit(
            topics, start_new_transaction=start_new_transaction)
        return did_commit

    async def _run_hooks(self, *moments: str) -> None:
        for moment in moments:
            for hook in list(self.hooks[moment].values()):
                await hook()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._persist()   # before faust's revoke: the tables still take writes
        await self._run_hooks(ON_REBALANCE)
        await super().on_partitions_revoked(revoked)

    def _record_span(self, message: Any) -> None:
        self._batch_spans.setdefault(message.tp, set()).add(message.span)

    async def on_partitions_assigned(self, assigned: Any, generation_id: int = 0) -> None:
        # Paused from the start (see *Records fetched for a paused partition*); faust
        # pauses them too, a few awaits later, and its recovery resumes them.
        batched = cast(BatchingTransport, self.transport).batched_topics
        self.pause_partitions({tp for tp in assigned if tp.topic in batched})
        # Recovery seeks when anything is assigned (a new rebalance starts this again).
        self.seek_pending = any(tp.topic in batched for tp in assigned)
        self._resume_after_seek = set()
        self._forget_batch_acks(assigned)   # acked by the previous generation
        self._ledger.forget()
        # See *Forgetting on a rebalance*.
        await self._run_hooks(ON_REBALANCE, BEFORE_ASSIGNMENT)
        await super().on_partitions_assigned(assigned, generation_id)

    def _forget_batch_acks(self, partitions: Any) -> None:
        batched = cast(BatchingTransport, self.transport).batched_topics
        for tp in partitions:
            if tp.topic in batched:
                self._acked.pop(tp, None)
                self._acked_index.pop(tp, None)
                self._batch_spans.pop(tp, None)

    def _new_offset(self, tp: Any) -> int | None:
        """For a batched partition: the end of the run of acked batches that starts at the
        committed offset (see :func:`committable`). The acks stay until a commit past them
        succeeded (:meth:`_commit_offsets`): a refused commit is tried again."""
        if tp.topic not in cast(BatchingTransport, self.transport).batched_topics:
            result: int | None = super()._new_offset(tp)
            return result
        spans = self._batch_spans.setdefault(tp, set())
        committed = self._committed_offset[tp]
        if committed is not None:
            self._forget_below(tp, committed)
        offset = committable(spans, committed)
        return offset

    def _forget_below(self, tp: Any, committed: int) -> None:
        """Drop the acks and spans the committed offset has passed."""
        done = {last for last in self._acked[tp] if last < committed}
        if done:
            self._acked[tp] = [last for last in self._acked[tp] if last not in done]
            self._acked_index[tp].difference_update(done)
        spans = self._batch_spans.setdefault(tp, set())
        spans.difference_update({span for span in spans if span[1] <= committed})

    async def _commit(self, offsets: Any) -> bool:
        did_commit: bool = await super()._commit(offsets)
        if not did_commit:   # what faust is about to overwrite (see _commit_offsets)
            batched = cast(BatchingTransport, self.transport).batched_topics
            self._refused = {tp: self._committed_offset[tp] for tp in offsets
                             if tp.topic in batched}
        return did_commit

    async def _commit_offsets(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        """faust's commit, except that a commit the broker refused leaves the committed
        offsets of batched partitions as they were. faust records the offsets as committed
        whether or not the broker took them (its ``_commit`` returns False for a commit
        refused because the group rebalanced meanwhile, after a flush that may take
        seconds), and never commits a partition again up to that offset: the partition's
        commit stays behind for good when no later batch arrives, the new generation's
        committed offsets are overwritten with the old one's, and a restart folds it all
        again."""
        self._refused = {}
        did_commit: bool = await super()._commit_offsets(
            offsets, start_new_transaction=start_new_transaction)
        self._committed_offset.update(self._refused)
        return did_commit

    def _to_message(self, tp: Any, record: Any) -> Any:
        if not isinstance(record, RecordBatch):
            return super()._to_message(tp, record)
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
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_min_bytes = fetch_min_bytes


def use_batching_transport(app: Any, batched_topics: Iterable[str], *,
                           fetch_max_wait_ms: int, fetch_min_bytes: int = 1) -> None:
    """Make ``app`` consume ``batched_topics`` in batches (call before declaring topics);
    the fetch options are the consumer's (see :class:`.options.ProcessorsOptions`)."""
    if getattr(app, "_transport", None) is not None:
        raise RuntimeError("the faust transport already exists: install batching first")
    app.transport = BatchingTransport(app.conf.broker_consumer, app, batched_topics,
                                      fetch_max_wait_ms, fetch_min_bytes)
