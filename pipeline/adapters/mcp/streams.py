"""A watch on a transport's read stream: its end means the server went away.

The SDK fails the calls in flight when the stream ends, but nothing tells its owner; this
wrapper sets an event when the stream ends (stdout closed because the server's process
exited, or the HTTP stream closed), so the supervisor restarts the server at once rather
than at the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import anyio
from mcp.client import Transport
from mcp.shared.message import SessionMessage


class EofWatch:
    """Delegates to the read stream; sets ``down`` when it ends or is closed."""

    def __init__(self, inner: Any, down: asyncio.Event) -> None:
        self._inner = inner
        self._down = down

    @staticmethod
    def transport(streams: tuple[Any, Any], down: asyncio.Event) -> Transport:
        """A transport that hands out ``streams`` with the read stream watched."""
        read, write = streams

        @contextlib.asynccontextmanager
        async def entered() -> AsyncIterator[tuple[Any, Any]]:
            yield EofWatch(read, down), write

        transport: Transport = entered()
        return transport

    @property
    def last_context(self) -> Any:  # the dispatcher looks for it (sender's contextvars)
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        try:
            item: SessionMessage | Exception = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._down.set()
            raise
        return item

    async def aclose(self) -> None:
        self._down.set()
        await self._inner.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc_val: BaseException | None, exc_tb: TracebackType | None) -> None:
        self._down.set()
        await self._inner.aclose()
