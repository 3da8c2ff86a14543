"""Rebuild the derived-messages projection from offset 0 into a new version, verify, switch.

Versions, the pointer topic and the handover that keeps a switched version live:
:mod:`pipeline.services.replay.versions`. After verifying, :func:`replay_projection` asks the
live processors to hold, extends the new version to the session topic's end
(:meth:`Rebuilder.extend`) and activates it with the offsets it covered.

The rebuild reads the session topic once (read committed, up to its end at the start), skips
non-surface records by their ``dsh.type`` header without decoding them, folds surface events
with core's :class:`~pipeline.core.surface.SurfaceFold` (its slot view,
:func:`~pipeline.core.projection.fold_slots`) exactly as the processors do, and publishes
the same slot-keyed change records. Duplicates are skipped; a gap or an invalid event stops
that session's fold (reported, never folded past).

Verification compares the new version's conversations with the active version's (read back
from its compacted topic; sessions that changed during the rebuild are counted, not compared:
:mod:`pipeline.services.replay.compare`), or, when there is none, with core's own fold of
the log (a second :class:`~pipeline.core.surface.SurfaceFold` keeping messages), and
lists every difference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from pipeline.adapters.kafka.records import Headers
from pipeline.adapters.kafka.topic_scan import (
    BulkProducer,
    BulkRecord,
    TopicScan,
    ensure_topic,
    topic_exists,
)
from pipeline.codec.outputs import DerivedChangeSerde, default_output_codecs
from pipeline.codec.records import (
    HEADER_SEQ,
    HEADER_TYPE,
    ConsumedRecord,
    session_id_of_key,
    source_headers,
)
from pipeline.core.errors import BrokerError, CodecError, EventError
from pipeline.core.events import SURFACE_TYPES, Event, JsonValue
from pipeline.core.projection import (
    ActivePointer,
    MessageChange,
    fold_slots,
    with_session,
)
from pipeline.core.surface import SurfaceFold
from pipeline.services.replay.compare import (
    Conversations,
    differences,
    moved_sessions,
    read_conversations,
    read_version,
)
from pipeline.services.replay.topic import Decoder
from pipeline.services.replay.versions import (
    HANDOVER_TIMEOUT_S,
    activate,
    active_version,
    claim_version,
    ensure_still_requested,
    refuse_while_handing_over,
    request_handover,
    version_topic,
    withdraw_handover,
)
from pipeline.settings import Settings

_SURFACE_TYPE_BYTES: Final = frozenset(t.encode() for t in SURFACE_TYPES)
SETTLE_S: Final = 1.0
_SCAN_BATCH: Final = 20_000  # records per fetch round: fewer per-batch costs
Progress = Callable[[str], None]


__all__ = ["RebuildResult", "Rebuilder", "ReplayOutcome", "differences", "hand_over",
           "read_conversations", "replay_projection"]


@dataclass(slots=True)
class _Session:
    session_id: str
    next_seq: int = 0
    stopped: bool = False
    slots: SurfaceFold = field(default_factory=lambda: SurfaceFold(keep_messages=False))
    messages: dict[int, JsonValue | None] = field(default_factory=dict)
    core: SurfaceFold | None = None
    last_change: int = -1  # seq of the last surface event that changed anything


@dataclass(slots=True)
class RebuildResult:
    version: int
    topic: str
    events: int = 0
    seconds: float = 0.0
    changes: int = 0  # slot changes folded (what the processors would have published)
    records_written: int = 0  # after coalescing by slot key (see Rebuilder)
    problems: list[str] = field(default_factory=list)
    conversations: Conversations = field(default_factory=dict)
    last_change: dict[str, int] = field(default_factory=dict)
    core: Conversations | None = None


class Rebuilder:
    """One rebuild of the projection into ``version_topic(settings, version)``.

    The target topic is new and compacted, so only the last change of each slot key matters:
    changes are coalesced by key in memory and written at the end, or after a batch of
    ``scan_batch`` records once ``coalesce_keys`` keys are pending. A slot removed before it
    was ever written needs no tombstone. The topic then holds, record for record, what
    compaction would have left of the processors' change stream (the synthetic mix writes
    about one record per 12 changes). Values are ``dsh.DerivedMessageChange`` Avro records
    written by ``encoder`` (single-object encoding unless given one with a registry id).
    """

    def __init__(self, settings: Settings, decode: Decoder, version: int, *,
                 with_core: bool = False, progress: Progress | None = None,
                 coalesce_keys: int = 200_000, scan_batch: int = _SCAN_BATCH,
                 encoder: DerivedChangeSerde | None = None) -> None:
        self.settings = settings
        self.decode = decode
        self.encoder = encoder or default_output_codecs().derived
        self.result = RebuildResult(version, version_topic(settings, version))
        self.with_core = with_core
        self.progress = progress or (lambda _line: None)
        self.sessions: dict[str, _Session] = {}
        self._by_key: dict[bytes | None, _Session] = {}
        # slot key -> its last change and the session-topic position of its event
        # record key (the slot key's bytes) -> its last change, source position, partition
        self._pending: dict[bytes, tuple[MessageChange, Headers, int]] = {}
        self._written: set[bytes] = set()  # record keys with a record on the topic
        self._coalesce_keys = coalesce_keys
        self._scan_batch = scan_batch
        self._next_offsets: dict[int, int] = {}

    async def run(self) -> RebuildResult:
        started = time.monotonic()
        source = self.settings.topics.session_events
        async with TopicScan(self.settings, source, batch=self._scan_batch) as scan:
            if not scan.exists:
                raise _nothing_to_replay(source)
            await ensure_topic(self.settings, self.result.topic, compact=True)
            async with BulkProducer(self.settings) as out:
                await self._fold_all(scan, out, started)
                await self._flush(out)
        self.result.seconds = time.monotonic() - started
        self.progress(_progress_line(self.result.events, self.result.events, started))
        self._collect()
        return self.result

    async def extend(self) -> None:
        """Fold what reached the session topic since :meth:`run` (or the last extend) into
        the same version, and wait for every record written to be acknowledged.

        TopicScan always starts at offset 0, so the records folded already are read again
        and skipped by offset (the scan costs what it costs, the fold nothing)."""
        started = time.monotonic()
        async with TopicScan(self.settings, self.settings.topics.session_events,
                             batch=self._scan_batch) as scan, BulkProducer(self.settings) as out:
            await self._fold_all(scan, out, started, skip_folded=True)
            await self._flush(out)
        self.result.seconds += time.monotonic() - started
        self._collect()

    def covered(self) -> dict[int, int]:
        """Per session-topic partition, the offset after the last record folded."""
        return dict(self._next_offsets)

    async def _fold_all(self, scan: TopicScan, out: BulkProducer, started: float, *,
                        skip_folded: bool = False) -> None:
        last_report = started
        done = dict(self._next_offsets) if skip_folded else {}
        async for batch in scan.client_batches():  # runs of one partition, not copied
            self._note_offsets(batch)
            if skip_folded:
                batch = [r for r in batch if r.offset >= done.get(r.partition, 0)]
            self._fold_batch(batch)
            self.result.events += len(batch)
            if len(self._pending) >= self._coalesce_keys:
                await self._flush(out)
            if time.monotonic() - last_report >= 0.5:
                last_report = time.monotonic()
                self.progress(_progress_line(self.result.events, scan.total, started))

    def _note_offsets(self, batch: Sequence[ConsumedRecord]) -> None:
        # A batch holds runs of one partition in offset order: the last record of each run
        # is enough, so this costs a comparison per record, not a dict write.
        ends = self._next_offsets
        previous = None
        for record in batch:
            if previous is not None and record.partition != previous.partition:
                ends[previous.partition] = previous.offset + 1
            previous = record
        if previous is not None:
            ends[previous.partition] = previous.offset + 1

    def _fold_batch(self, batch: Sequence[ConsumedRecord]) -> None:
        # The hot loop (about 96% of the records are not surface events): a record whose
        # first two headers are dsh.type (not a surface type) and dsh.seq (digits) only
        # advances its session's seq; anything else takes the general path.
        by_key = self._by_key
        for record in batch:
            state = by_key.get(record.key)
            if state is None or state.stopped:
                if state is None:
                    self._fold_general(record)
                continue
            headers = record.headers
            if len(headers) >= 2:
                name, type_ = headers[0]
                seq_name, seq = headers[1]
                if name == HEADER_TYPE and seq_name == HEADER_SEQ and seq is not None \
                        and type_ is not None and type_ not in _SURFACE_TYPE_BYTES \
                        and seq.isdigit():
                    if int(seq) == state.next_seq:
                        state.next_seq += 1
                    else:
                        self._advance(state, int(seq), record)
                    continue
            self._fold_general(record)

    def _fold_general(self, record: ConsumedRecord) -> None:
        """Any record: headers read by name, the value decoded unless not a surface type."""
        try:
            state = self._by_key.get(record.key) or self._session_of(record.key)
            if state.stopped:
                return
            headers = dict(record.headers)
            type_, seq = headers.get(HEADER_TYPE), headers.get(HEADER_SEQ)
            if type_ is not None and seq is not None and type_ not in _SURFACE_TYPE_BYTES \
                    and seq.isdigit():
                self._advance(state, int(seq), record)
                return
            _sid, event = self.decode(record.value or b"")
        except CodecError as exc:
            self.result.problems.append(f"{_where(record)}: undecodable: {exc}")
            return
        if self._advance(state, event.seq, record):
            self._apply(state, event, record)

    def _session_of(self, key: bytes | None) -> _Session:
        session_id = session_id_of_key(key)
        state = self.sessions.get(session_id)
        if state is None:
            state = self.sessions[session_id] = _Session(session_id, core=self._core())
        self._by_key[key] = state
        return state

    def _core(self) -> SurfaceFold | None:
        return SurfaceFold() if self.with_core else None

    def _advance(self, state: _Session, seq: int, record: ConsumedRecord) -> bool:
        """True when ``seq`` is the next one (it is then consumed)."""
        if seq < state.next_seq:
            return False  # a duplicate: folded already
        if seq > state.next_seq:
            state.stopped = True
            self.result.problems.append(f"{state.session_id}: gap at {_where(record)}: "
                                        f"expected seq {state.next_seq}, found {seq}; not "
                                        "folded past")
            return False
        state.next_seq += 1
        return True

    def _apply(self, state: _Session, event: Event, record: ConsumedRecord) -> None:
        if event.type not in SURFACE_TYPES:
            return
        try:
            changes = with_session(fold_slots(state.slots, event), state.session_id)
            if state.core is not None:
                state.core.apply(event)
        except EventError as exc:
            state.stopped = True
            self.result.problems.append(f"{state.session_id}: invalid event at "
                                        f"{_where(record)}: {exc}")
            return
        if changes:
            state.last_change = event.seq
        pending = self._pending
        source = source_headers(record.partition, record.offset)  # as the processors write
        for change in changes:
            if change.kind == "remove":
                state.messages.pop(change.slot, None)
            else:
                state.messages[change.slot] = change.message
            pending[change.key.encode()] = (change, source, record.partition)
        self.result.changes += len(changes)

    async def _flush(self, out: BulkProducer) -> None:
        """Write the last change of every pending slot key (a removal: a tombstone, only
        for a key the topic holds)."""
        pending, self._pending = self._pending, {}
        # the session layout (claim_version): a change lies in its event's partition
        await out.send_many(self.result.topic, self._records(pending),
                            partition_of=lambda key: pending[key][2])
        await out.flush()

    def _records(self, pending: dict[bytes, tuple[MessageChange, Headers, int]]
                 ) -> Iterator[BulkRecord]:
        written, encode = self._written, self.encoder.encode_change
        for key, (change, source, _partition) in pending.items():
            if change.kind == "remove":
                if key not in written:
                    continue
                written.discard(key)
                yield key, None, source
            else:
                written.add(key)
                yield key, encode(change), source
            self.result.records_written += 1

    def _collect(self) -> None:
        self.result.conversations = {
            sid: [m for _slot, m in sorted(s.messages.items()) if m is not None]
            for sid, s in self.sessions.items() if s.messages}
        self.result.last_change = {sid: s.last_change for sid, s in self.sessions.items()
                                   if s.last_change >= 0}
        if self.with_core:
            self.result.core = {sid: list(s.core.messages()) for sid, s in self.sessions.items()
                                if s.core is not None and len(s.core)}


def _where(record: ConsumedRecord) -> str:
    return f"{record.topic}[{record.partition}]@{record.offset}"


def _progress_line(done: int, total: int, started: float) -> str:
    elapsed = max(time.monotonic() - started, 1e-6)
    rate = done / elapsed
    eta = (total - done) / rate if rate > 0 and total > done else 0.0
    width = 30
    filled = int(width * done / total) if total else width
    bar = "#" * filled + "-" * (width - filled)
    return f"[{bar}] {done}/{total} events  {rate:,.0f} events/s  ETA {eta:.0f}s"


@dataclass(slots=True)
class ReplayOutcome:
    result: RebuildResult
    compared_with: str
    differences: list[str]
    switched: bool
    held: bool = False  # live processors held for the handover
    moved: list[str] = field(default_factory=list)  # changed during the rebuild: not compared
    live_undecodable: int = 0  # records of the active version skipped (not compared)
    live_problems: list[str] = field(default_factory=list)  # one line per skipped record


async def replay_projection(settings: Settings, decode: Decoder, *, force: bool = False,
                            progress: Progress | None = None,
                            handover_timeout_s: float = HANDOVER_TIMEOUT_S,
                            encoder: DerivedChangeSerde | None = None) -> ReplayOutcome:
    """Rebuild into a new version, verify it, and when it verified (or ``force``) hand it
    over from the live processors and switch readers to it (see ``versions``). ``encoder``
    writes the new version's records (default: single-object encoding)."""
    if not await topic_exists(settings, settings.topics.session_events):
        raise _nothing_to_replay(settings.topics.session_events)
    await refuse_while_handing_over(settings)   # before reading or rebuilding anything
    active = await active_version(settings)
    live = await read_version(settings, active.topic)
    version = await claim_version(settings, active)
    rebuilder = Rebuilder(settings, decode, version, with_core=not (live and live.conversations),
                          progress=progress, encoder=encoder)
    result = await rebuilder.run()
    moved: set[str] = set()
    if live and live.conversations:
        compared_with = f"version {active.version} ({active.topic})"
        moved = moved_sessions(live.last_change, result.last_change)
        found = differences(live.conversations, result.conversations, f"v{active.version}",
                            skip=moved)
    else:
        compared_with = "core's derivation of the log (no live version yet)"
        found = differences(result.core or {}, result.conversations, "core")
    outcome = ReplayOutcome(result, compared_with, found, switched=force or not found,
                            moved=sorted(moved),
                            live_undecodable=live.undecodable if live else 0,
                            live_problems=list(live.problems) if live else [])
    if outcome.switched:
        outcome.held = await hand_over(settings, rebuilder, timeout_s=handover_timeout_s)
    return outcome


def _nothing_to_replay(source: str) -> BrokerError:
    return BrokerError(f"topic {source!r} does not exist: nothing to replay (check "
                       "DSH_BOOTSTRAP_SERVERS and DSH_TOPIC_PREFIX)")


async def hand_over(settings: Settings, rebuilder: Rebuilder, *,
                    timeout_s: float = HANDOVER_TIMEOUT_S) -> bool:
    """Steps 2-3 of the handover: hold the live writers (True when some were registered),
    extend the rebuilt version to the topic's end, activate it with what it covered."""
    version = rebuilder.result.version
    request = await request_handover(settings, version, timeout_s=timeout_s)
    held = request is not None
    try:
        if held:
            # The extension reads up to the last stable offset. A worker reading uncommitted
            # records (faust's default without exactly-once) may have folded records of a
            # driver transaction still open when it held: give such transactions (tens of
            # milliseconds) time to end, so that the stable offset is past them.
            await asyncio.sleep(SETTLE_S)
        await rebuilder.extend()
        if request is not None:
            await ensure_still_requested(settings, request)
    except BaseException:
        if request is not None:   # the writers resume on the old version
            await withdraw_handover(settings, request)
        raise
    await activate(settings, ActivePointer(version, rebuilder.result.topic,
                                           rebuilder.result.events, rebuilder.covered()))
    return held
