"""One session's live stream: its snapshot from the outputs, then its events from there on.

The stream subscribes to the hub (the dashboard's live tail) *before* anything else, reads
the session's snapshot (:mod:`.session_start`: derived messages, fleet row, and the
session-topic offset they were published at), sends it as ``snapshot``, then reads the
session's partition from that offset to its current end and follows the hub; events
delivered twice are dropped by seq, so each event after the snapshot is sent exactly once.
Every event is an SSE ``event`` message with ``id: <seq>``. A reconnecting EventSource sends
its last seq: when the new snapshot does not pass it, only the events after it are sent (no
snapshot); otherwise the page gets a fresh snapshot and starts over.

The derived messages are kept current from the snapshot's slots with the live surface events
(core's surface fold seen as slots, :func:`pipeline.core.projection.fold_slots`) and sent as
``derived`` when they changed and the stream has caught up with what is queued. The fleet
row is sent as ``row`` whenever the processors publish a new one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from pipeline.adapters.kafka.event_stream import session_records
from pipeline.core.errors import DshError
from pipeline.core.events import SURFACE_TYPES, Event, JsonValue, Replace
from pipeline.core.projection import fold_slots
from pipeline.core.surface import UNKNOWN_RESULT, SurfaceFold
from pipeline.services.dashboard.hub import Subscriber
from pipeline.services.dashboard.service import DashboardService
from pipeline.services.dashboard.session_start import SessionStart, session_start
from pipeline.services.dashboard.sse import HEARTBEAT_S, frame, heartbeat

# The snapshots that name the seq the page continues with (the others take what comes).
EXACT_BASES = frozenset({"processors", "derived"})


@dataclass(slots=True)
class Transcript:
    """What one stream has sent: the next seq (None: take the first that comes), and the
    derived messages folded on from the snapshot."""

    session_id: str
    send_from: int
    next_seq: int | None
    slots: SurfaceFold
    messages: dict[int, JsonValue | None] = field(default_factory=dict)
    at_seq: int = -1
    replaced: bool = False
    derived_dirty: bool = False
    fold_error: str | None = None

    @classmethod
    def after(cls, start: SessionStart, send_from: int) -> Transcript:
        next_seq = start.at_seq + 1 if start.basis in EXACT_BASES else None
        return cls(start.session_id, send_from, next_seq,
                   # the snapshot does not say which nodes are tool results: the viewer
                   # leaves the tool-result replacement rules to the processors
                   SurfaceFold.from_json([[slot, seq, UNKNOWN_RESULT]
                                          for slot, seq in start.nodes]),
                   dict(start.messages), start.at_seq)

    def fold(self, event: Event) -> None:
        self.next_seq = event.seq + 1
        if self.fold_error is not None or event.type not in SURFACE_TYPES \
                or event.surface_op is None:
            return
        try:
            changes = fold_slots(self.slots, event)
        except DshError as exc:
            self.fold_error = f"seq {event.seq}: {exc}"
            self.derived_dirty = True
            return
        for change in changes:
            if change.kind == "remove":
                self.messages.pop(change.slot, None)
            else:
                self.messages[change.slot] = change.message
        self.at_seq = event.seq
        self.derived_dirty = True
        self.replaced = self.replaced or isinstance(event.surface_op, Replace)

    def derived(self) -> dict[str, JsonValue]:
        self.derived_dirty = False
        live = [(slot, seq) for slot, seq in self.slots.slots()
                if self.messages.get(slot) is not None]
        return {"session": self.session_id, "atSeq": self.at_seq,
                "replaced": self.replaced, "error": self.fold_error,
                "messages": [self.messages[slot] for slot, _ in live],
                "seqs": [seq for _, seq in live]}


async def stream_session(response: web.StreamResponse, service: DashboardService,
                         session_id: str, resume: int | None) -> None:
    """Write the session's SSE stream until the client goes or falls behind."""
    subscriber = service.hub.subscribe_session(session_id)
    try:
        start = await session_start(service, session_id)
        if resume is not None and resume >= start.at_seq and start.basis in EXACT_BASES:
            transcript = Transcript.after(start, resume + 1)
        else:
            transcript = Transcript.after(start, start.at_seq + 1)
            await response.write(frame("snapshot", {
                **start.to_json(), "processorsError": service.processors_error}))
        if start.from_offset is not None:
            async for record in session_records(
                    service.settings, session_id, decode=service.decode,
                    from_offset=start.from_offset, read=service.reads.saw):
                await _send(response, transcript, record.event)
        await response.write(frame("caught-up", {"nextSeq": transcript.next_seq}))
        await _follow(response, transcript, subscriber)
    finally:
        service.hub.unsubscribe(subscriber)


async def _follow(response: web.StreamResponse, transcript: Transcript,
                  subscriber: Subscriber) -> None:
    while True:
        if transcript.derived_dirty and subscriber.queue.empty():
            await response.write(frame("derived", transcript.derived()))
        try:
            name, item = await asyncio.wait_for(subscriber.queue.get(), HEARTBEAT_S)
        except TimeoutError:
            await heartbeat(response)
            continue
        if name == "overflow":
            return  # fell behind: the client reconnects and resumes
        if name == "row":
            await response.write(frame("row", item))
            continue
        expected = transcript.next_seq
        if expected is not None and item.seq > expected:
            return  # missed events: the client reconnects and resumes
        await _send(response, transcript, item)


async def _send(response: web.StreamResponse, transcript: Transcript, event: Event) -> None:
    if transcript.next_seq is not None and event.seq != transcript.next_seq:
        return
    transcript.fold(event)
    if event.seq >= transcript.send_from:
        await response.write(frame("event", event.to_json(), str(event.seq)))
