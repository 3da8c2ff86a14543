"""Server-Sent Events framing (the ``text/event-stream`` format) for aiohttp responses."""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web

from pipeline.core.events import JsonValue, dumps_json

RETRY_MS: Final = 1000
HEARTBEAT_S: Final = 15.0


def frame(name: str, data: JsonValue, event_id: str | None = None) -> bytes:
    """One SSE message; the JSON data has no raw newline, so it is one ``data:`` line."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {dumps_json(data)}\n\n".encode()


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Start an SSE response (no buffering by proxies, reconnect after ``RETRY_MS``)."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache, no-transform",
        "X-Accel-Buffering": "no",
    })
    await response.prepare(request)
    await response.write(f"retry: {RETRY_MS}\n\n".encode())
    return response


async def heartbeat(response: web.StreamResponse) -> None:
    """A comment line, so idle connections stay open and dead ones are noticed."""
    await response.write(b": keep-alive\n\n")


def last_event_id(request: web.Request) -> int | None:
    """The ``Last-Event-ID`` header (or ``last_event_id`` query) as a seq, if it is one."""
    raw: Any = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
