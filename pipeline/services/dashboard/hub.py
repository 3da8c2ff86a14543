"""Fan-out from the one session-topic reader to the open Server-Sent Events streams.

Each stream has its own bounded queue. A stream that cannot keep up (its queue is full) is
closed rather than blocking the reader or growing without limit; the browser's EventSource
reconnects by itself and catches up (the session stream resumes from ``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.core.events import Event

QUEUE_LIMIT: Final = 10_000
OVERFLOW: Final = ("overflow", None)

Message = tuple[str, Any]


@dataclass(eq=False, slots=True)
class Subscriber:
    """One open stream: its queue, and whether it fell behind."""

    queue: asyncio.Queue[Message] = field(
        default_factory=lambda: asyncio.Queue(maxsize=QUEUE_LIMIT))
    overflowed: bool = False

    def offer(self, message: Message) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.overflowed = True
            self.queue.get_nowait()  # room for the marker that ends the stream
            self.queue.put_nowait(OVERFLOW)


class Hub:
    """Fleet subscribers get rows and charts; session subscribers get their session's events
    and fleet row."""

    def __init__(self) -> None:
        self.fleet: set[Subscriber] = set()
        self.sessions: dict[str, set[Subscriber]] = {}

    @property
    def clients(self) -> int:
        return len(self.fleet) + sum(len(s) for s in self.sessions.values())

    def subscribe_fleet(self) -> Subscriber:
        subscriber = Subscriber()
        self.fleet.add(subscriber)
        return subscriber

    def subscribe_session(self, session_id: str) -> Subscriber:
        subscriber = Subscriber()
        self.sessions.setdefault(session_id, set()).add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.fleet.discard(subscriber)
        for session_id, subscribers in list(self.sessions.items()):
            subscribers.discard(subscriber)
            if not subscribers:
                del self.sessions[session_id]

    def publish_event(self, session_id: str, event: Event) -> None:
        for subscriber in self.sessions.get(session_id, ()):
            subscriber.offer(("event", event))

    def publish_row(self, session_id: str, row: Any) -> None:
        for subscriber in self.sessions.get(session_id, ()):
            subscriber.offer(("row", row))

    def publish_fleet(self, name: str, payload: Any) -> None:
        for subscriber in self.fleet:
            subscriber.offer((name, payload))
