"""The one place where the MCP SDK's, anyio's and the transports' exceptions become
:class:`~pipeline.core.errors.ToolServerError` (the rest of the driver never sees them).

Codes: ``CONNECTION_CLOSED`` (the server went away: its process ended, the stream closed),
``UNAVAILABLE`` (it could not be started or reached), ``TIMEOUT`` (the SDK's own request
timeout), ``PROTOCOL`` (a JSON-RPC error answer, or an answer that does not parse). The
message is scrubbed of the server's secrets (``McpServerConfig.scrub``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import anyio
import httpx2
import mcp_types
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from pipeline.core.errors import ToolServerError

# The JSON-RPC codes the SDK uses for its own failures, as our codes.
_SDK_CODES: Final = {mcp_types.CONNECTION_CLOSED: "CONNECTION_CLOSED",
                     mcp_types.REQUEST_TIMEOUT: "TIMEOUT"}
# Codes after which the connection is not to be trusted again: the supervisor restarts it.
CONNECTION_LOST: Final = frozenset({"CONNECTION_CLOSED", "UNAVAILABLE"})
MAX_DETAIL: Final = 500


def tool_server_error(server: str, exc: BaseException, scrub: Callable[[str], str]
                      ) -> ToolServerError:
    """``exc`` (raised by the SDK or a transport while using ``server``) in our error tree."""
    exc = _innermost(exc)
    code = _code_of(exc)
    detail = scrub(str(exc) or type(exc).__name__)[:MAX_DETAIL]
    if isinstance(exc, ValidationError):  # pydantic's text quotes the input: keep it short
        detail = f"the server's answer does not parse ({exc.error_count()} problems)"
    return ToolServerError(f"MCP server {server!r}: {type(exc).__name__}: {detail}",
                           server=server, code=code)


def _innermost(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (task groups wrap what failed inside them)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _code_of(exc: BaseException) -> str:
    if isinstance(exc, MCPError):
        return _SDK_CODES.get(exc.code, "PROTOCOL")
    if isinstance(exc, anyio.EndOfStream | anyio.ClosedResourceError
                  | anyio.BrokenResourceError | BrokenPipeError | ConnectionResetError):
        return "CONNECTION_CLOSED"
    if isinstance(exc, OSError | httpx2.HTTPError):
        return "UNAVAILABLE"
    if isinstance(exc, TimeoutError):
        return "TIMEOUT"
    return "PROTOCOL"
