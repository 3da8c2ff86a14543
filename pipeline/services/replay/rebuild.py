"""Rebuild the derived-messages projection from offset 0 into a new version, verify, switch.

Versions: version 0 is the processors' live topic (``<prefix>derived-messages``); version N
is ``<prefix>derived-messages.vN``. The active version is recorded in the compacted control
topic ``<prefix>projection-versions`` (key ``derived-messages``, value
``{"projection","version","topic","events"}``); readers ask :func:`active_version` (the SDK's
``derived_conversations`` does) and get version 0 when nothing was switched yet.

The rebuild reads the session topic once (read committed, up to its end at the start), skips
non-surface records by their ``dsh.type`` header without decoding them, folds surface events
with core's :class:`~pipeline.core.projection.SurfaceSlots` exactly as the processors do, and
publishes the same slot-keyed change records. Duplicates are skipped; a gap or an invalid
event stops that session's fold (reported, never folded past).

Verification compares the new version's conversations with the active version's (read back
from its compacted topic), or, when there is none, with core's own fold of the log
(:class:`~pipeline.core.surface.SurfaceFold`), and lists every difference.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.adapters.kafka.records import InboxRecord
from pipeline.adapters.kafka.topic_scan import BulkProducer, TopicScan, ensure_topic, topic_exists
from pipeline.codec.records import HEADER_SEQ, HEADER_TYPE, session_id_of_key
from pipeline.core.errors import BrokerError, CodecError, EventError
from pipeline.core.events import SURFACE_TYPES, Event, JsonValue, dumps_json
from pipeline.core.projection import (
    MessageChange,
    SurfaceSlots,
    rebuild_conversations,
    with_session,
)
from pipeline.core.surface import SurfaceFold
from pipeline.core.validation import projected_message
from pipeline.services.replay.topic import Decoder
from pipeline.settings import Settings

PROJECTION: Final = "derived-messages"
_SURFACE_TYPE_BYTES: Final = frozenset(t.encode() for t in SURFACE_TYPES)
_SCAN_BATCH: Final = 20_000  # records per fetch round: fewer per-batch costs
Progress = Callable[[str], None]
Conversations = dict[str, list[JsonValue]]


def pointer_topic(settings: Settings) -> str:
    return f"{settings.topic_prefix}projection-versions"


def version_topic(settings: Settings, version: int) -> str:
    base = settings.topics.derived_messages
    return base if version == 0 else f"{base}.v{version}"


@dataclass(frozen=True, slots=True)
class ActiveVersion:
    version: int
    topic: str


async def active_version(settings: Settings) -> ActiveVersion:
    """The version readers use: the last switch recorded, else version 0."""
    latest: dict[str, Any] | None = None
    async with TopicScan(settings, pointer_topic(settings)) as scan:
        async for batch in scan.batches():
            for record in batch:
                if record.key == PROJECTION.encode() and record.value is not None:
                    latest = json.loads(record.value)
    if latest is None:
        return ActiveVersion(0, version_topic(settings, 0))
    return ActiveVersion(int(latest["version"]), str(latest["topic"]))


async def switch_to(settings: Settings, version: int, events: int) -> None:
    """Record ``version`` as the active one (readers switch on their next lookup)."""
    await ensure_topic(settings, pointer_topic(settings), compact=True)
    value = {"projection": PROJECTION, "version": version,
             "topic": version_topic(settings, version), "events": events}
    async with BulkProducer(settings) as producer:
        await producer.send(pointer_topic(settings), PROJECTION.encode(),
                            dumps_json(value).encode())


async def read_conversations(settings: Settings, topic: str) -> Conversations | None:
    """The conversations a compacted derived-messages topic holds (None: no such topic)."""
    pairs: list[tuple[str, JsonValue | None]] = []
    async with TopicScan(settings, topic) as scan:
        if not scan.exists:
            return None
        async for batch in scan.batches():
            pairs.extend((r.key.decode("utf-8") if r.key else "",
                          json.loads(r.value) if r.value is not None else None) for r in batch)
    return {sid: list(msgs) for sid, msgs in rebuild_conversations(pairs).items()}


@dataclass(slots=True)
class _Session:
    session_id: str
    next_seq: int = 0
    stopped: bool = False
    slots: SurfaceSlots = field(default_factory=SurfaceSlots)
    messages: dict[int, JsonValue | None] = field(default_factory=dict)
    core: SurfaceFold | None = None


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
    core: Conversations | None = None


class Rebuilder:
    """One rebuild of the projection into ``version_topic(settings, version)``.

    The target topic is new and compacted, so only the last change of each slot key matters:
    changes are coalesced by key in memory (at most ``coalesce_keys`` keys between flushes)
    and written at the end or, after a batch of ``scan_batch`` records, when that many keys
    are pending. A slot removed before it was
    ever written needs no tombstone. The topic then holds, record for record, what
    compaction would have left of the processors' change stream (the synthetic mix writes
    about one record per 17 changes).
    """

    def __init__(self, settings: Settings, decode: Decoder, version: int, *,
                 with_core: bool = False, progress: Progress | None = None,
                 coalesce_keys: int = 200_000, scan_batch: int = _SCAN_BATCH) -> None:
        self.settings = settings
        self.decode = decode
        self.result = RebuildResult(version, version_topic(settings, version))
        self.with_core = with_core
        self.progress = progress or (lambda _line: None)
        self.sessions: dict[str, _Session] = {}
        self._by_key: dict[bytes | None, _Session] = {}
        self._pending: dict[str, MessageChange] = {}  # slot key -> its last change
        self._written: set[str] = set()  # slot keys with a record on the topic
        self._coalesce_keys = coalesce_keys
        self._scan_batch = scan_batch

    async def run(self) -> RebuildResult:
        started = time.monotonic()
        source = self.settings.topics.session_events
        async with TopicScan(self.settings, source, batch=self._scan_batch) as scan:
            if not scan.exists:
                raise BrokerError(f"topic {source!r} does not exist: nothing to replay (check "
                                  "DSH_BOOTSTRAP_SERVERS and DSH_TOPIC_PREFIX)")
            await ensure_topic(self.settings, self.result.topic, compact=True)
            async with BulkProducer(self.settings) as out:
                await self._fold_all(scan, out, started)
                await self._flush(out)
        self.result.seconds = time.monotonic() - started
        self.progress(_progress_line(self.result.events, self.result.events, started))
        self._collect()
        return self.result

    async def _fold_all(self, scan: TopicScan, out: BulkProducer, started: float) -> None:
        last_report = started
        async for batch in scan.batches():
            self._fold_batch(batch)
            self.result.events += len(batch)
            if len(self._pending) >= self._coalesce_keys:
                await self._flush(out)
            if time.monotonic() - last_report >= 0.5:
                last_report = time.monotonic()
                self.progress(_progress_line(self.result.events, scan.total, started))

    def _fold_batch(self, batch: Sequence[InboxRecord]) -> None:
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

    def _fold_general(self, record: InboxRecord) -> None:
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

    def _advance(self, state: _Session, seq: int, record: InboxRecord) -> bool:
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

    def _apply(self, state: _Session, event: Event, record: InboxRecord) -> None:
        if event.type not in SURFACE_TYPES:
            return
        try:
            message = projected_message(event) if event.surface_op is not None else None
            changes = with_session(state.slots.apply(event, message), state.session_id)
            if state.core is not None:
                state.core.apply(event)
        except EventError as exc:
            state.stopped = True
            self.result.problems.append(f"{state.session_id}: invalid event at "
                                        f"{_where(record)}: {exc}")
            return
        pending = self._pending
        for change in changes:
            if change.kind == "remove":
                state.messages.pop(change.slot, None)
            else:
                state.messages[change.slot] = change.message
            pending[change.key] = change
        self.result.changes += len(changes)

    async def _flush(self, out: BulkProducer) -> None:
        """Write the last change of every pending slot key (a removal: a tombstone, only
        for a key the topic holds)."""
        pending, self._pending = self._pending, {}
        topic, written = self.result.topic, self._written
        for key, change in pending.items():
            if change.kind == "remove":
                if key not in written:
                    continue
                written.discard(key)
                await out.send(topic, key.encode(), None)
            else:
                written.add(key)
                await out.send(topic, key.encode(), dumps_json(change.to_json()).encode())
            self.result.records_written += 1
        await out.flush()

    def _collect(self) -> None:
        self.result.conversations = {
            sid: [m for _slot, m in sorted(s.messages.items()) if m is not None]
            for sid, s in self.sessions.items() if s.messages}
        if self.with_core:
            self.result.core = {sid: list(s.core.messages()) for sid, s in self.sessions.items()
                                if s.core is not None and len(s.core)}


def _where(record: InboxRecord) -> str:
    return f"{record.topic}[{record.partition}]@{record.offset}"


def _progress_line(done: int, total: int, started: float) -> str:
    elapsed = max(time.monotonic() - started, 1e-6)
    rate = done / elapsed
    eta = (total - done) / rate if rate > 0 and total > done else 0.0
    width = 30
    filled = int(width * done / total) if total else width
    bar = "#" * filled + "-" * (width - filled)
    return f"[{bar}] {done}/{total} events  {rate:,.0f} events/s  ETA {eta:.0f}s"


def differences(live: Mapping[str, Sequence[JsonValue]], new: Mapping[str, Sequence[JsonValue]],
                live_name: str = "live") -> list[str]:
    """Every difference between two sets of conversations, one line each."""
    found: list[str] = []
    for sid in sorted(set(live) | set(new)):
        a, b = live.get(sid), new.get(sid)
        if a is None or b is None:
            which = live_name if a is None else "new version"
            found.append(f"{sid}: missing in the {which}")
            continue
        for index in range(max(len(a), len(b))):
            x = a[index] if index < len(a) else None
            y = b[index] if index < len(b) else None
            if x != y:
                found.append(f"{sid}: message {index} differs: {live_name} "
                             f"{_short(x)} != new {_short(y)}")
    return found


def _short(message: JsonValue | None) -> str:
    text = "(none)" if message is None else dumps_json(message)
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass(slots=True)
class ReplayOutcome:
    result: RebuildResult
    compared_with: str
    differences: list[str]
    switched: bool


async def next_version(settings: Settings, active: ActiveVersion) -> int:
    version = active.version + 1
    while await topic_exists(settings, version_topic(settings, version)):
        version += 1  # left by an earlier rebuild that was not switched to
    return version


async def replay_projection(settings: Settings, decode: Decoder, *, force: bool = False,
                            progress: Progress | None = None) -> ReplayOutcome:
    """Rebuild into a new version, verify it, and switch to it when it verified (or ``force``)."""
    active = await active_version(settings)
    live = await read_conversations(settings, active.topic)
    version = await next_version(settings, active)
    rebuilder = Rebuilder(settings, decode, version, with_core=not live, progress=progress)
    result = await rebuilder.run()
    if live:
        compared_with = f"version {active.version} ({active.topic})"
        found = differences(live, result.conversations, f"v{active.version}")
    else:
        compared_with = "core's derivation of the log (no live version yet)"
        found = differences(result.core or {}, result.conversations, "core")
    switched = force or not found
    if switched:
        await switch_to(settings, version, result.events)
    return ReplayOutcome(result, compared_with, found, switched)
