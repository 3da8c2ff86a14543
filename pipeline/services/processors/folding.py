"""Session-topic records -> published changes and table updates, one fetched batch at a time.

:class:`SessionFolder` puts the session stage together: the pure batch step
(:class:`.planning.FoldState`, over core's folds) and the one executor that performs its plans
(:class:`pipeline.adapters.faust.executor.PlanExecutor`: reads the log back when a plan wants
it, sends the outputs, writes the dead letters, keeps the table writes for the next persist),
and serves the HTTP views what is folded and not yet persisted. Tables are plain
``MutableMapping`` values here (faust tables in the worker, dicts in unit tests); sending
goes through one ``Send`` callable (faust's producer in the worker). The worker hands over
everything one fetch returned for a partition (see :mod:`pipeline.adapters.faust.transport`);
:meth:`SessionFolder.handle` is the same for a single record.

Delivery rules (DESIGN.md section 2): a seq below the next expected one is a duplicate
(skipped, counted). A seq above it means the worker's state is behind the log, and **the
log is right**: the worker reads the session's missing records back from the session topic
(``read_back``, a search back bounded by the session's own span) and folds them, with a
metric and a log line naming the session (:mod:`.planning`). Only a gap the log
itself has, or one after an event the session stopped at, is reported (counted, logged,
dead-lettered with the reason, never folded past). An ``assistant/chunk`` is recognised by
its ``dsh.type`` header and only advances the session's cursor, without being decoded; a
record that does not decode, or an event that breaks a surface rule, is dead-lettered and
processing goes on. So is an event after which the session's table records could exceed
the producer's record limit (:func:`.session_state.refuse_oversize`): its session stops
there, like at a broken rule. A record is dead-lettered at most once
(:mod:`pipeline.adapters.kafka.dlq_book`).

**Crash consistency** (the rules are :mod:`pipeline.adapters.faust.pending`'s): a batch's
offsets are committed only once its outputs are acknowledged and its table writes made and
acknowledged (nodes before the session records that name them). Everything the batches
decide for one session is ONE ``sessions`` record, written once per commit: after a crash it
holds all of the session's events since the previous commit or none, and redelivery from the
committed offset skips what it holds and applies the rest once. ``nodes`` holds the
projected message of each LIVE surface node only; nothing a session keeps grows with its
number of events (``?at_seq=`` is read back from the session topic). Outputs are sent at
once, so a crash can only repeat them (same key and value on the compacted topics; the
per-model stage drops a repeated sample by seq). Fleet status and session usage are
published once per session per batch, derived-message changes one record per change; values
are Avro (:mod:`pipeline.codec.outputs`), usage samples to the internal per-model topic
JSON.

**Chunks and gaps after a kill -9.** Chunks (about 80% of the records) change no table but
move the session's cursor. At every persist the cursor of each session they moved is
written: in the ``sessions`` record when that is written anyway, else in the small
``chunk_marks`` table (one write per session per commit, not per chunk). So at every
committed offset the tables know exactly which seq each session expects next, and the first
record redelivered after a restart is judged against that: a missing seq is a gap whether or
not a restart fell next to it. (The alternative, accepting a jump over the chunk seqs that
the next ``assistant/message`` lists in ``sourceEventSeqs``, would report false gaps: the
chunks of a failed provider attempt, or of a stream cut by a crash and closed by crash
repair, are listed by no message.) Cursors are also cached in memory
(:attr:`.planning.FoldState.cursors`) together with the decoded states; both run ahead of
the tables until the next persist (the HTTP views read them, :meth:`SessionFolder.current`)
and are dropped on every rebalance.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from pipeline.adapters.faust.executor import Flush, PersistOutcome, PlanExecutor, ReadBack
from pipeline.adapters.faust.pending import PendingWrites
from pipeline.adapters.kafka.dlq import MAX_RECORD_BYTES
from pipeline.adapters.kafka.dlq_book import DeadLetterBook, DeadLettered, DeadLetterSink
from pipeline.adapters.kafka.records import OutRecord
from pipeline.codec.outputs import OutputCodecs, default_output_codecs
from pipeline.codec.records import ConsumedRecord
from pipeline.services.processors.counters import DeliveryCounters
from pipeline.services.processors.planning import (
    STATE_CACHE_MAX,
    BatchPlan,
    Decoder,
    DerivedTopics,
    FoldState,
    folded_cursor,
    stored_record,
)
from pipeline.services.processors.session_state import SessionState, SessionTables
from pipeline.settings import TopicNames

__all__ = ["STATE_CACHE_MAX", "Decoder", "ReadBack", "Send", "SessionFolder"]

# Returns, when the sender has one, the record's delivery (awaitable until the broker
# acknowledged it): see *Outputs before state* in :mod:`pipeline.adapters.faust.pending`.
Send = Callable[[OutRecord], Awaitable[object]]


class DerivedRoute(DerivedTopics, Protocol):
    """:class:`.planning.DerivedTopics` with the wait a batch passes first (a
    :class:`pipeline.adapters.kafka.projection_follow.ProjectionFollow` in the worker)."""

    async def gate(self, partition: int, offset: int) -> str | None: ...


class SessionFolder:
    """The session stage: plans each batch (:class:`.planning.FoldState`) and has the
    executor perform the plan; what is folded and not yet persisted, for the views."""

    def __init__(self, tables: SessionTables, send: Send, decode: Decoder, topics: TopicNames,
                 usage_topic: str, counters: DeliveryCounters,
                 route: DerivedRoute | None = None, *,
                 outputs: OutputCodecs | None = None,
                 max_record_bytes: int = MAX_RECORD_BYTES,
                 dead_lettered: DeadLettered | None = None,
                 read_back: ReadBack | None = None,
                 dead_letter_sink: DeadLetterSink | None = None) -> None:
        # Avro encoders of the output topics (single-object encoding unless given ones
        # with registry ids); the internal usage-by-model topic stays JSON.
        self.fold = FoldState(tables, decode, topics, usage_topic,
                              outputs or default_output_codecs(), counters, max_record_bytes,
                              route, can_heal=read_back is not None)
        self.pending = self.fold.pending = PendingWrites(counters, self.fold)
        letters = DeadLetterBook(dead_lettered, dead_letter_sink, counters=counters,
                                 max_record_bytes=max_record_bytes)
        self.executor: PlanExecutor[BatchPlan] = PlanExecutor(
            self.fold, send, letters, self.pending, read_back=read_back)
        self.counters = counters
        self.route = route  # None: always the derived-messages topic of ``topics``

    @property
    def tables(self) -> SessionTables:
        return self.fold.tables

    @tables.setter
    def tables(self, tables: SessionTables) -> None:
        self.fold.tables = tables

    @property
    def decode(self) -> Decoder:
        return self.fold.decode

    @decode.setter
    def decode(self, decode: Decoder) -> None:
        self.fold.decode = decode

    @property
    def outputs(self) -> OutputCodecs:
        return self.fold.outputs

    @outputs.setter
    def outputs(self, outputs: OutputCodecs) -> None:
        self.fold.outputs = outputs

    @property
    def send(self) -> Send:
        return self.executor.send

    @send.setter
    def send(self, send: Send) -> None:
        self.executor.send = send

    @property
    def states(self) -> dict[str, SessionState]:
        """The decoded sessions as folded so far (see :meth:`forget`)."""
        return self.fold.states

    @property
    def folded_to(self) -> dict[int, int]:
        """Partition -> the last offset of its last batch folded whole: every record up to
        it is in :attr:`states` or the tables (cleared when any cached state is given up)."""
        return self.pending.folded_to

    @property
    def route(self) -> DerivedRoute | None:
        return self._route

    @route.setter
    def route(self, route: DerivedRoute | None) -> None:
        self._route = self.fold.route = route
        self.executor.gate = None if route is None else route.gate

    @property
    def read_back(self) -> ReadBack | None:
        return self.executor.read_back

    @read_back.setter
    def read_back(self, read_back: ReadBack | None) -> None:
        self.executor.read_back, self.fold.can_heal = read_back, read_back is not None

    @property
    def max_record_bytes(self) -> int:
        """The producer's record limit: no table record, output or dead letter above it."""
        return self.fold.max_record_bytes

    @max_record_bytes.setter
    def max_record_bytes(self, limit: int) -> None:
        self.fold.max_record_bytes = self.executor.letters.max_record_bytes = limit

    async def handle(self, record: ConsumedRecord) -> None:
        await self.executor.fold((record,))

    async def handle_batch(self, records: Sequence[ConsumedRecord], batch: Any = None
                           ) -> None:
        """Plan the records of one partition (in order) and perform the plan
        (:meth:`pipeline.adapters.faust.executor.PlanExecutor.fold`)."""
        await self.executor.fold(records, batch)

    async def persist(self, flush: Flush | None = None) -> PersistOutcome:
        """Write what the plans changed to the tables (see
        :mod:`pipeline.adapters.faust.pending`)."""
        return await self.executor.persist(flush)

    async def forget(self) -> None:
        """Drop what is cached in memory and not persisted (partitions moved: others fold
        them from the committed offset)."""
        await self.executor.forget()

    def node(self, partition: int, key: str) -> Any:
        """A ``nodes`` record as folded so far (ahead of the table until the next persist)."""
        return self.pending.node(partition, key, self.tables)

    def cursor(self, session_id: str) -> int:
        """The seq the session expects next as folded so far (0: unknown)."""
        return folded_cursor(self.fold, session_id)

    def current(self, session_id: str) -> SessionState | None:
        """The session as folded so far (ahead of its table record until the next persist);
        None for a session without a record (unknown, or only chunks folded)."""
        state = self.states.get(session_id)
        if state is None:
            raw = stored_record(self.fold, session_id)
            state = None if raw is None else SessionState.from_json(session_id, raw)
        return state
