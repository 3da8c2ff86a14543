"""The otel service: session events in, one trace per ended turn out, offsets after the ack.

A loop over batches of the session topic (its own consumer group, span types only):

1. fold each event into its session's :class:`~pipeline.core.genai_spans.SessionTraces`;
   a ``turn/end`` yields the turn's spans (:func:`~pipeline.core.genai_spans.build_spans`);
2. export the ended turns' spans (at most ``max_spans_per_request`` a request) and wait for
   the receiver's acknowledgement; the exporter retries 429/502/503/504 and an absent
   receiver without end (lag, not loss);
3. a request refused (400, 413) is retried turn by turn; a turn still refused goes to the dead
   letter topic (value: the OTLP request of that turn alone; headers: the reason and the
   ``turn/end`` record it came from), as does an undecodable record;
4. commit, per partition, the offset after the last record read, but never past the first
   record of a turn still open: a restart reads that turn again and exports it when it ends.

Exporting a turn twice (a restart between the ack and the commit) sends the same trace and
span ids: receivers keyed by id keep one. A final receiver error (neither success, retryable
nor refused) stops the service without committing (:class:`OtlpFailed`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.adapters.kafka.dlq import dead_letter
from pipeline.adapters.kafka.event_batches import EventBatch
from pipeline.adapters.kafka.records import InboxRecord, OutRecord, header_value
from pipeline.adapters.otlp.client import OtlpRejected
from pipeline.codec.records import HEADER_TRACEPARENT, record_key
from pipeline.core.genai_spans import SessionTraces, build_spans
from pipeline.core.genai_trace import Span
from pipeline.services.otel.metrics import OtelMetrics

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    async def next_batch(self, *, timeout_ms: int = ..., max_records: int = ...
                         ) -> EventBatch: ...
    def assigned(self) -> set[int]: ...
    async def commit_offsets(self, offsets: Mapping[int, int]) -> None: ...


class SpanExporter(Protocol):
    async def export(self, body: bytes) -> int: ...


Encoder = Callable[[Sequence[Span]], bytes]
DeadLetterSender = Callable[[Sequence[OutRecord]], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class OtelOptions:
    """``max_idle_sessions``: sessions without an open turn kept in memory (their last
    request header's model, for a later failed step that names none); past it the oldest
    are forgotten."""

    with_content: bool = False
    max_spans_per_request: int = 512
    batch_records: int = 2000
    poll_timeout_ms: int = 200
    max_idle_sessions: int = 100_000


@dataclass(slots=True)
class EndedTurn:
    session_id: str
    topic: str
    partition: int
    offset: int  # of its turn/end record
    spans: list[Span]


@dataclass(slots=True)
class _Partition:
    read_up_to: int = 0  # next offset to read
    committed: int = -1
    open: dict[str, int] = field(default_factory=dict)  # session -> offset of its turn/start


class OtelService:
    """One member of the otel consumer group; :meth:`run` until ``stop`` is set."""

    def __init__(self, source: BatchSource, exporter: SpanExporter, *, encode: Encoder,
                 send_dead_letters: DeadLetterSender, dlq_topic: str,
                 metrics: OtelMetrics | None = None, options: OtelOptions | None = None
                 ) -> None:
        self._source = source
        self._exporter = exporter
        self._encode = encode
        self._send_dead_letters = send_dead_letters
        self._dlq_topic = dlq_topic
        self.metrics = metrics if metrics is not None else OtelMetrics()
        self.options = options or OtelOptions()
        self._sessions: dict[str, tuple[int, SessionTraces]] = {}
        self._partitions: dict[int, _Partition] = {}
        self.running = False
        self.turns_exported = 0
        self.dead_lettered = 0
        self.metrics.oldest_open_turn.set_function(self.oldest_open_turn_seconds)

    def oldest_open_turn_seconds(self, now_ms: int | None = None) -> float:
        """How long the oldest open turn has been open (by its ``turn/start`` time)."""
        starts = [traces.open.start_ms for _, traces in self._sessions.values()
                  if traces.open is not None]
        if not starts:
            return 0.0
        now = time.time() * 1000 if now_ms is None else now_ms
        return max(0.0, (now - min(starts)) / 1000)

    async def run(self, stop: asyncio.Event) -> None:
        self.running = True
        try:
            while not stop.is_set():
                await self.step()
        finally:
            self.running = False

    def health(self) -> tuple[bool, dict[str, object]]:
        return self.running, {
            "partitions": sorted(self._partitions),
            "open_turns": sum(len(p.open) for p in self._partitions.values()),
            "turns_exported": self.turns_exported, "dead_lettered": self.dead_lettered,
            "offsets_read": sum(p.read_up_to for p in self._partitions.values())}

    async def step(self) -> int:
        """One batch: fold, export, dead-letter, commit. Returns the records folded."""
        batch = await self._source.next_batch(timeout_ms=self.options.poll_timeout_ms,
                                              max_records=self.options.batch_records)
        self._forget_unowned()
        ended = self._fold(batch)
        letters = [dead_letter(record, exc) for record, exc in batch.undecodable]
        letters += await self._export(ended)
        if letters:
            await self._send_dead_letters(letters)
            self.dead_lettered += len(letters)
            self.metrics.dead_letters.inc(len(letters))
        for partition, offset in batch.last_offsets.items():
            self._partition(partition).read_up_to = offset + 1
        await self._commit()
        return len(batch.records)

    def _partition(self, number: int) -> _Partition:
        found = self._partitions.get(number)
        if found is None:
            found = self._partitions[number] = _Partition()
        return found

    def _forget_unowned(self) -> None:
        """State of partitions given away: their next owner reads from the committed offset."""
        owned = self._source.assigned()
        for number in [p for p in self._partitions if p not in owned]:
            del self._partitions[number]
            for session in [s for s, (p, _) in self._sessions.items() if p == number]:
                del self._sessions[session]

    def _fold(self, batch: EventBatch) -> list[EndedTurn]:
        ended: list[EndedTurn] = []
        for record in batch.records:
            entry = self._sessions.get(record.session_id)
            if entry is None:
                entry = self._sessions[record.session_id] = (
                    record.partition, SessionTraces(record.session_id))
            traces = entry[1]
            parent = header_value(record.headers, HEADER_TRACEPARENT)
            partial = traces.skipped_partial
            turn = traces.add(record.event, record.offset,
                              parent.decode("ascii", "replace") if parent else None)
            if traces.skipped_partial > partial:
                self.metrics.partial_turns.inc()
            partition = self._partition(record.partition)
            if traces.open_since is not None:
                partition.open[record.session_id] = traces.open_since
            else:
                partition.open.pop(record.session_id, None)
            if turn is not None:
                ended.append(EndedTurn(record.session_id, record.topic, record.partition,
                                       record.offset,
                                       build_spans(turn, with_content=self.options.with_content)))
        self.metrics.events.inc(len(batch.records))
        self.metrics.open_turns.set(sum(len(p.open) for p in self._partitions.values()))
        if len(self._sessions) > self.options.max_idle_sessions:
            self._forget_idle_sessions()
        return ended

    def _forget_idle_sessions(self) -> None:
        """Drop the oldest sessions without an open turn, down to 90% of the limit."""
        excess = len(self._sessions) - int(self.options.max_idle_sessions * 0.9)
        idle = [sid for sid, (_, traces) in self._sessions.items() if traces.open is None]
        for session in idle[:excess]:
            del self._sessions[session]

    async def _export(self, ended: list[EndedTurn]) -> list[OutRecord]:
        """Export every ended turn; the dead letters of those the receiver refused."""
        letters: list[OutRecord] = []
        for chunk in _chunks(ended, self.options.max_spans_per_request):
            try:
                await self._export_turns(chunk)
            except OtlpRejected as exc:
                if len(chunk) == 1:
                    letters.append(self._dead_letter(chunk[0], exc))
                    continue
                for turn in chunk:  # find the turn(s) refused; export the others
                    try:
                        await self._export_turns([turn])
                    except OtlpRejected as one:
                        letters.append(self._dead_letter(turn, one))
        return letters

    async def _export_turns(self, turns: Sequence[EndedTurn]) -> None:
        spans = [span for turn in turns for span in turn.spans]
        rejected = await self._exporter.export(self._encode(spans))
        if rejected:
            self.metrics.rejected.inc(rejected)
        self.metrics.spans.inc(len(spans))
        self.metrics.turns.inc(len(turns))
        self.metrics.chat_spans(spans)
        self.turns_exported += len(turns)

    def _dead_letter(self, turn: EndedTurn, error: OtlpRejected) -> OutRecord:
        log.warning("turn of session %r (%s[%d]@%d) refused by the OTLP receiver: %s",
                    turn.session_id, turn.topic, turn.partition, turn.offset, error)
        record = InboxRecord(turn.topic, turn.partition, turn.offset,
                             record_key(turn.session_id), self._encode(turn.spans))
        letter = dead_letter(record, error)
        return OutRecord(self._dlq_topic, letter.key, letter.value, letter.headers)

    async def _commit(self) -> None:
        points: dict[int, int] = {}
        for number, partition in self._partitions.items():
            point = min([partition.read_up_to, *partition.open.values()])
            if point > partition.committed:
                points[number] = point
        if points:
            await self._source.commit_offsets(points)
            for number, point in points.items():
                self._partitions[number].committed = point


def _chunks(turns: list[EndedTurn], max_spans: int) -> list[list[EndedTurn]]:
    chunks: list[list[EndedTurn]] = []
    current: list[EndedTurn] = []
    size = 0
    for turn in turns:
        if current and size + len(turn.spans) > max_spans:
            chunks.append(current)
            current, size = [], 0
        current.append(turn)
        size += len(turn.spans)
    if current:
        chunks.append(current)
    return chunks
