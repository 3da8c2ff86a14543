"""One supervised connection to one MCP server, as dsh's ``connection.ts`` keeps it.

A supervisor task owns the connection's generations (the SDK binds a session to one
transport for life): it starts the server (a child process over stdio, or a Streamable HTTP
session), lists its tools, re-lists them on ``notifications/tools/list_changed`` (a failed
re-list keeps the last good list), and when the connection goes down, starts a new
generation after a backoff: delays double from ``initial_delay_s`` up to ``max_delay_s``;
``max_attempts`` consecutive failures give up (the tools are then withdrawn). A connection
that stayed up for ``max_delay_s`` ends the outage, so the next one gets a fresh budget.

A generation is down when the server's stream ends (its process exited: seen at once, by a
watch on the read stream) or a call finds the connection closed or unreachable. While no
generation is up, :meth:`call` raises ``ToolServerError`` (``UNAVAILABLE``) at once: the
caller turns that into an error result the model sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx2
import mcp_types
from mcp.client import Client, IncomingMessage
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from pipeline.adapters.mcp.config import McpServerConfig
from pipeline.adapters.mcp.errors import CONNECTION_LOST, tool_server_error
from pipeline.adapters.mcp.names import public_tool_name
from pipeline.adapters.mcp.streams import EofWatch
from pipeline.core.errors import ToolServerError
from pipeline.core.events import JsonValue

log = logging.getLogger(__name__)

CLIENT_INFO: Final = mcp_types.Implementation(name="dsh-pipeline", version="0.1.0")
CLOSE_TIMEOUT_S: Final = 5.0  # the SDK's stdio teardown has two 2 s grace periods
MAX_LIST_PAGES: Final = 100  # a paginator that never ends cannot hang a re-list


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """dsh's defaults (``RECONNECT_DEFAULTS``): 0.5 s doubling to 30 s, 10 attempts."""

    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    max_attempts: int = 10

    def delay(self, failures: int) -> float:
        return float(min(self.max_delay_s, self.initial_delay_s * 2 ** (failures - 1)))


@dataclass(frozen=True, slots=True)
class McpTool:
    """One tool of a server: its wire name, its public name, what the model is told."""

    server: str
    raw_name: str
    public_name: str
    description: str
    input_schema: Mapping[str, JsonValue]
    read_only: bool


class McpServerConnection:
    """A supervised connection; :meth:`start`, :meth:`call`, then :meth:`close`."""

    def __init__(self, config: McpServerConfig, *,
                 policy: ReconnectPolicy | None = None) -> None:
        self.config = config
        self.policy = policy or ReconnectPolicy()
        self.state = "stopped"  # starting, connected, restarting, failed, closed
        self.restarts = 0
        self.tools: dict[str, McpTool] = {}  # by public name: the last good listing
        self.tool_lists = 0
        self._client: Client | None = None
        self._down: asyncio.Event | None = None
        self._first_attempt = asyncio.Event()
        self._stopping = asyncio.Event()  # cuts a backoff wait short on close
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def name(self) -> str:
        return self.config.name

    async def start(self, wait_s: float = 30.0) -> None:
        """Start supervising; wait up to ``wait_s`` for the first attempt to connect or fail
        (a server that is not up by then keeps being retried in the background)."""
        self.state = "starting"
        self._supervisor = asyncio.create_task(self._supervise(), name=f"mcp:{self.name}")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._first_attempt.wait()

    async def close(self) -> None:
        """Stop the server (or the HTTP session) and the supervisor."""
        self._closing = True
        self._stopping.set()
        if self._down is not None:
            self._down.set()
        task, self._supervisor = self._supervisor, None
        if task is not None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await asyncio.shield(task)
            except TimeoutError:
                log.error("MCP server %r did not stop within %g s; cancelling", self.name,
                          CLOSE_TIMEOUT_S)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.state = "closed"

    async def call(self, raw_name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """``tools/call`` on the live generation: the result as a JSON object.

        Raises ``ToolServerError``: ``UNAVAILABLE`` at once when no generation is up; a lost
        connection also marks the generation down, so the supervisor restarts it.
        """
        client, down = self._client, self._down
        if client is None or down is None or down.is_set():
            why = (f"it failed {self.policy.max_attempts} restarts in a row"
                   if self.state == "failed" else "it is being restarted")
            raise ToolServerError(f"MCP server {self.name!r} is not connected ({why})",
                                  server=self.name, code="UNAVAILABLE")
        try:
            result = await client.call_tool(raw_name, arguments)
        except Exception as exc:
            error = tool_server_error(self.name, exc, self.config.scrub)
            if error.code in CONNECTION_LOST:
                down.set()
            raise error from None
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)

    def status(self) -> dict[str, JsonValue]:
        """For /health and logs: no env, headers, args or URL."""
        return {**self.config.describe(), "state": self.state, "tools": len(self.tools),
                "restarts": self.restarts}

    # -- the supervisor ---------------------------------------------------------------------

    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            connected_at = await self._generation()
            if self._closing:
                break
            if connected_at is not None and (time.monotonic() - connected_at
                                             >= self.policy.max_delay_s):
                failures = 0
            failures += 1
            if failures > self.policy.max_attempts:
                self.state, self.tools = "failed", {}
                log.error("MCP server %r: giving up after %d failed attempts in a row; its "
                          "tools are withdrawn until the driver restarts", self.name,
                          self.policy.max_attempts)
                break
            delay = self.policy.delay(failures)
            self.state = "restarting"
            log.warning("MCP server %r: connection %s; restarting in %.1f s (attempt %d/%d)",
                        self.name, "lost" if connected_at is not None else "failed", delay,
                        failures, self.policy.max_attempts)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
            if self._closing:
                break
            self.restarts += 1
        self._first_attempt.set()

    async def _generation(self) -> float | None:
        """Run one generation until it goes down; when it was up, the time it connected."""
        down, changed = asyncio.Event(), asyncio.Event()
        connected_at = None
        try:
            async with self._client_for(down, changed) as client:
                await self._list_tools(client)
                self._client, self._down = client, down
                self.state, connected_at = "connected", time.monotonic()
                self._first_attempt.set()
                await self._serve(client, down, changed)
        except Exception as exc:
            error = tool_server_error(self.name, exc, self.config.scrub)
            log.warning("MCP server %r: %s", self.name, error)
        finally:
            self._client = None
            self._first_attempt.set()
        return connected_at

    async def _serve(self, client: Client, down: asyncio.Event, changed: asyncio.Event
                     ) -> None:
        """Re-list on ``list_changed`` until the generation is down (or the driver stops)."""
        while not down.is_set() and not self._closing:
            waiters = [asyncio.ensure_future(down.wait()), asyncio.ensure_future(changed.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if changed.is_set() and not down.is_set():
                changed.clear()
                try:
                    await self._list_tools(client)
                    log.info("MCP server %r: tool list changed: %d tools", self.name,
                             len(self.tools))
                except Exception as exc:  # keep serving the last good list, as dsh does
                    log.error("MCP server %r: tool re-list failed: %s", self.name,
                              tool_server_error(self.name, exc, self.config.scrub))

    @contextlib.asynccontextmanager
    async def _client_for(self, down: asyncio.Event, changed: asyncio.Event
                          ) -> AsyncIterator[Client]:
        async def on_message(message: IncomingMessage) -> None:
            if isinstance(message, mcp_types.ToolListChangedNotification):
                changed.set()

        async with self._transport(down) as streams:
            client = Client(EofWatch.transport(streams, down), mode="legacy",
                            message_handler=on_message, client_info=CLIENT_INFO, cache=None)
            async with client:
                yield client

    @contextlib.asynccontextmanager
    async def _transport(self, down: asyncio.Event) -> AsyncIterator[Any]:
        config = self.config
        if config.command is not None:
            params = StdioServerParameters(
                command=config.command, args=list(config.args), cwd=config.cwd,
                env={k: v.reveal() for k, v in config.env.items()})
            async with stdio_client(params) as streams:
                yield streams
            return
        assert config.url is not None
        headers = {k: v.reveal() for k, v in config.headers.items()}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0)
                                      ) as http, streamable_http_client(
                                          config.url, http_client=http) as streams:
            yield streams

    async def _list_tools(self, client: Client) -> None:
        """Fetch every page, then swap the whole list (a failure leaves the old one)."""
        tools: dict[str, McpTool] = {}
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                public = public_tool_name(self.name, tool.name)
                if public in tools:
                    raise ToolServerError(f"MCP server {self.name!r} listed tool "
                                          f"{tool.name!r} twice", server=self.name,
                                          code="PROTOCOL")
                annotations = tool.annotations
                tools[public] = McpTool(
                    self.name, tool.name, public, tool.description or "",
                    dict(tool.input_schema),
                    read_only=bool(annotations is not None and annotations.read_only_hint))
            cursor = page.next_cursor
            if cursor is None:
                break
        self.tools = tools
        self.tool_lists += 1
