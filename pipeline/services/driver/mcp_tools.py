"""The MCP servers' tools as the driver's tools (a :class:`~.tools.ToolSource`).

Each tool of each configured server is offered under dsh's public name
(``mcp__{server}__{tool}``) with its input schema unchanged. A call goes to the server's
supervised connection; whatever goes wrong becomes an error result the model sees, never an
exception out of the turn:

- the server answers ``isError``: ``McpToolError``/``MCP_TOOL_ERROR`` with its text;
- the server is down or restarting, the connection breaks mid-call, a JSON-RPC error:
  ``McpServerError`` with the code of :class:`~pipeline.core.errors.ToolServerError`
  (``UNAVAILABLE``, ``CONNECTION_CLOSED``, ``PROTOCOL``, ``TIMEOUT``);
- the call takes longer than ``timeout_s`` (``DSH_TOOL_TIMEOUT``): the registry's
  ``ToolTimeoutError``/``TOOL_TIMEOUT``, and the SDK tells the server the call is cancelled.

A result never carries the server's own secrets: its text is scrubbed of the server's env
and header values before it reaches the log (a server that prints its environment, as
server-everything's ``get-env`` does, would otherwise put them in the events).

A tool runs alongside others of the same step when its server is configured
``"parallelSafe": true`` or the tool is annotated ``readOnlyHint``; otherwise one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pipeline.adapters.mcp import McpServerConnection, McpTool, outcome_of
from pipeline.core.errors import ToolServerError
from pipeline.core.events import JsonValue
from pipeline.core.turn_effects import ToolOutcome
from pipeline.services.driver.tools import ToolHandler, ToolSpec

log = logging.getLogger(__name__)

MCP_SERVER_ERROR: Final = "McpServerError"
DEFAULT_TOOL_TIMEOUT_S: Final = 60.0  # dsh's DEFAULT_TOOL_CALL_TIMEOUT_MS


class McpTools:
    """The tools of several MCP servers; :meth:`start` before use, :meth:`close` after."""

    def __init__(self, connections: Sequence[McpServerConnection], *,
                 timeout_s: float = DEFAULT_TOOL_TIMEOUT_S) -> None:
        self.connections = list(connections)
        self.timeout_s = timeout_s
        self._built: dict[str, tuple[int, dict[str, ToolSpec]]] = {}

    async def start(self, wait_s: float = 30.0) -> None:
        """Start every server; wait (at most ``wait_s``) for each's first attempt."""
        await asyncio.gather(*(c.start(wait_s) for c in self.connections))
        for connection in self.connections:
            log.info("MCP server %r: %s, %d tools", connection.name, connection.state,
                     len(connection.tools))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.connections))

    def status(self) -> list[dict[str, JsonValue]]:
        """Each server's name, transport, state, tool count and restarts (no secrets)."""
        return [c.status() for c in self.connections]

    def specs(self) -> Mapping[str, ToolSpec]:
        specs: dict[str, ToolSpec] = {}
        for connection in self.connections:
            specs.update(self._specs_of(connection))
        return specs

    def _specs_of(self, connection: McpServerConnection) -> dict[str, ToolSpec]:
        """The connection's tools as specs, rebuilt only when it listed them anew."""
        built = self._built.get(connection.name)
        version = connection.tool_lists if connection.tools else -1
        if built is not None and built[0] == version:
            return built[1]
        specs = {}
        for tool in connection.tools.values():
            if tool.input_schema.get("type") != "object":
                log.warning("MCP server %r: tool %r is left out: its input schema is not of "
                            "type 'object'", connection.name, tool.raw_name)
                continue
            specs[tool.public_name] = ToolSpec(
                tool.public_name, tool.description, tool.input_schema,
                _handler(connection, tool), timeout_s=self.timeout_s,
                parallel_safe=connection.config.parallel_safe or tool.read_only)
        self._built[connection.name] = (version, specs)
        return specs


def _handler(connection: McpServerConnection, tool: McpTool) -> ToolHandler:
    async def call(arguments: dict[str, Any]) -> ToolOutcome:
        try:
            result = await connection.call(tool.raw_name, arguments)
        except ToolServerError as exc:
            return ToolOutcome.failure(str(exc), name=MCP_SERVER_ERROR, code=exc.code)
        outcome = outcome_of(result, server=connection.name, raw_name=tool.raw_name)
        return _scrubbed(outcome, connection)
    return call


def _scrubbed(outcome: ToolOutcome, connection: McpServerConnection) -> ToolOutcome:
    if not connection.config.secrets():
        return outcome
    content = tuple({**block, "text": connection.config.scrub(block["text"])}
                    if isinstance(block, dict) and isinstance(block.get("text"), str)
                    else block for block in outcome.content)
    return ToolOutcome(content, outcome.is_error, outcome.error, outcome.meta)
