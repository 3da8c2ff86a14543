"""One session's live stream: catch up from the session topic, then follow it live.

The stream subscribes to the hub *before* catching up (the SDK's :func:`session_records`
reads the session's partition to its current end), so no event falls between the two;
events delivered twice are dropped by seq. Every event is sent as an SSE ``event`` message
with ``id: <seq>``, so a reconnecting EventSource resumes after the last seq it saw. The
derived messages (the core surface fold, what the model sees) are sent as ``derived`` when
they changed and the stream has caught up with what is queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from pipeline.adapters.kafka.event_stream import Decoder, session_records
from pipeline.core.errors import DshError
from pipeline.core.events import Event, JsonValue, Replace
from pipeline.core.surface import SurfaceFold
from pipeline.services.dashboard.hub import Hub, Subscriber
from pipeline.services.dashboard.sse import HEARTBEAT_S, frame, heartbeat
from pipeline.settings import Settings


@dataclass(slots=True)
class Transcript:
    """What one stream has sent: the next seq, and the surface fold for derived messages."""

    session_id: str
    send_from: int
    next_seq: int = 0
    surface: SurfaceFold = field(default_factory=SurfaceFold)
    replaced: bool = False
    derived_dirty: bool = False
    fold_error: str | None = None

    def fold(self, event: Event) -> None:
        self.next_seq = event.seq + 1
        if self.fold_error is not None:
            return
        try:
            change = self.surface.apply(event)
        except DshError as exc:
            self.fold_error = f"seq {event.seq}: {exc}"
            self.derived_dirty = True
            return
        if change is not None:
            self.derived_dirty = True
            self.replaced = self.replaced or isinstance(event.surface_op, Replace)

    def derived(self) -> dict[str, JsonValue]:
        self.derived_dirty = False
        return {"session": self.session_id, "atSeq": self.next_seq - 1,
                "replaced": self.replaced, "error": self.fold_error,
                "messages": list(self.surface.messages()),
                "seqs": list(self.surface.seqs())}


async def stream_session(response: web.StreamResponse, settings: Settings, decode: Decoder,
                         hub: Hub, session_id: str, send_from: int) -> None:
    """Write the session's SSE stream until the client goes or falls behind."""
    subscriber = hub.subscribe_session(session_id)
    transcript = Transcript(session_id, send_from)
    try:
        async for record in session_records(settings, session_id, decode=decode):
            await _send(response, transcript, record.event)
        await response.write(frame("caught-up", {"nextSeq": transcript.next_seq}))
        await _follow(response, transcript, subscriber)
    finally:
        hub.unsubscribe(subscriber)


async def _follow(response: web.StreamResponse, transcript: Transcript,
                  subscriber: Subscriber) -> None:
    while True:
        if transcript.derived_dirty and subscriber.queue.empty():
            await response.write(frame("derived", transcript.derived()))
        try:
            name, event = await asyncio.wait_for(subscriber.queue.get(), HEARTBEAT_S)
        except TimeoutError:
            await heartbeat(response)
            continue
        if name == "overflow" or event.seq > transcript.next_seq:
            return  # fell behind, or missed events: the client reconnects and resumes
        if event.seq == transcript.next_seq:
            await _send(response, transcript, event)


async def _send(response: web.StreamResponse, transcript: Transcript, event: Event) -> None:
    if event.seq != transcript.next_seq:
        return
    transcript.fold(event)
    if event.seq >= transcript.send_from:
        await response.write(frame("event", event.to_json(), str(event.seq)))
