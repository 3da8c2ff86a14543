"""MCP servers as the driver's tools: the ``mcpServers`` configuration, dsh's public tool
names, supervised connections (stdio and Streamable HTTP) on the official ``mcp`` SDK, and
results rendered as dsh tool results. Only this package imports the SDK."""

from pipeline.adapters.mcp.config import McpServerConfig, load_mcp_config, parse_mcp_config
from pipeline.adapters.mcp.connection import McpServerConnection, McpTool, ReconnectPolicy
from pipeline.adapters.mcp.names import public_tool_name
from pipeline.adapters.mcp.results import outcome_of

__all__ = ["McpServerConfig", "McpServerConnection", "McpTool", "ReconnectPolicy",
           "load_mcp_config", "outcome_of", "parse_mcp_config", "public_tool_name"]
