"""The MCP servers a driver uses, read from the ``mcpServers`` file format.

The format is the one MCP clients already share (Claude Desktop, Cursor, dsh's examples)::

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem",
                                              "/srv/data"], "env": {"TOKEN": "..."}},
        "search": {"url": "https://mcp.example.com/mcp",
                   "headers": {"Authorization": "Bearer ..."}}}}

A server with ``command`` runs as a child process over stdio (optional ``args``, ``env``,
``cwd``); one with ``url`` is reached over Streamable HTTP (optional ``headers``). The key is
the server's name: it is what the tools' public names carry (``mcp__files__read_file``),
whatever the server calls itself, and must match dsh's ``[A-Za-z0-9_-]{1,32}``.

Two keys are dsh-pipeline's own: ``"parallelSafe": true`` lets the driver run this server's
calls alongside each other (otherwise only tools annotated ``readOnlyHint`` do), and
``"disabled": true`` leaves a server out.

``env`` and ``headers`` values are secrets: held as :class:`~pipeline.settings.Secret`, never
printed, and :meth:`McpServerConfig.scrub` masks them in any text about the server (an
error message can quote a URL or a command's output).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.core.errors import ConfigError
from pipeline.settings import MASK, Secret

SERVER_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,32}")
# Values shorter than this are not searched for in messages: masking every "1" of an
# ``{"DEBUG": "1"}`` would garble the text and protects nothing.
MIN_SCRUBBED_LENGTH: Final = 4
_STDIO_KEYS: Final = frozenset({"command", "args", "env", "cwd"})
_HTTP_KEYS: Final = frozenset({"url", "headers"})
_OWN_KEYS: Final = frozenset({"parallelSafe", "disabled", "type", "transport"})


@dataclass(frozen=True, slots=True)
class McpServerConfig:
    """One configured server: stdio (``command``) or Streamable HTTP (``url``)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, Secret] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, Secret] = field(default_factory=dict)
    parallel_safe: bool = False

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "streamable-http"

    def secrets(self) -> list[str]:
        """The secret values (env and headers), longest first."""
        values = [s.reveal() for s in (*self.env.values(), *self.headers.values())]
        return sorted((v for v in values if v), key=len, reverse=True)

    def scrub(self, text: str) -> str:
        """``text`` with every secret value of this server masked."""
        for value in self.secrets():
            if len(value) >= MIN_SCRUBBED_LENGTH:
                text = text.replace(value, MASK)
        return text

    def describe(self) -> dict[str, str]:
        """What may be shown about the server (health, logs): no env, headers, args or URL."""
        return {"name": self.name, "transport": self.transport}


def load_mcp_config(path: str) -> tuple[McpServerConfig, ...]:
    """The servers of the ``mcpServers`` file at ``path``; ConfigError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except OSError as exc:
        raise ConfigError(f"MCP config {path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # the message quotes a position, not the file's content
        raise ConfigError(f"MCP config {path}: not JSON ({type(exc).__name__} at line "
                          f"{getattr(exc, 'lineno', '?')})") from None
    return parse_mcp_config(document, where=f"MCP config {path}")


def parse_mcp_config(document: Any, *, where: str = "MCP config") -> tuple[McpServerConfig, ...]:
    """The servers of an already-parsed ``{"mcpServers": {...}}`` document."""
    if not isinstance(document, dict) or not isinstance(document.get("mcpServers"), dict):
        raise ConfigError(f'{where}: expected an object {{"mcpServers": {{NAME: {{...}}}}}}')
    servers = []
    for name, entry in document["mcpServers"].items():
        if not SERVER_NAME.fullmatch(name):
            raise ConfigError(f"{where}: server name {name!r} must match [A-Za-z0-9_-]{{1,32}} "
                              "(it becomes part of the tools' public names)")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: server {name!r} must be an object")
        if entry.get("disabled") is True:
            continue
        servers.append(_server(name, entry, f"{where}: server {name!r}"))
    return tuple(servers)


def _server(name: str, entry: dict[str, Any], where: str) -> McpServerConfig:
    unknown = sorted(set(entry) - _STDIO_KEYS - _HTTP_KEYS - _OWN_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}")
    has_command, has_url = "command" in entry, "url" in entry
    if has_command == has_url:
        raise ConfigError(f"{where}: give exactly one of 'command' (stdio) or 'url' "
                          "(Streamable HTTP)")
    mixed = sorted(set(entry) & (_HTTP_KEYS if has_command else _STDIO_KEYS))
    if mixed:
        raise ConfigError(f"{where}: {mixed} do not go with "
                          f"{'command' if has_command else 'url'}")
    parallel = entry.get("parallelSafe", False)
    if not isinstance(parallel, bool):
        raise ConfigError(f"{where}: 'parallelSafe' must be true or false")
    if has_command:
        return McpServerConfig(
            name, command=_text(entry["command"], f"{where}: 'command'"),
            args=tuple(_text(a, f"{where}: 'args'") for a in _list(entry.get("args", []), where)),
            env=_secrets(entry.get("env", {}), f"{where}: 'env'"),
            cwd=None if entry.get("cwd") is None else _text(entry["cwd"], f"{where}: 'cwd'"),
            parallel_safe=parallel)
    url = _text(entry["url"], f"{where}: 'url'")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: 'url' must be an http:// or https:// URL")
    return McpServerConfig(name, url=url, headers=_secrets(entry.get("headers", {}),
                                                           f"{where}: 'headers'"),
                           parallel_safe=parallel)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: 'args' must be a list of strings")
    return value


def _secrets(value: Any, where: str) -> dict[str, Secret]:
    """String values only; the message never quotes a value (they are secrets)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be an object of strings")
    bad = sorted(k for k, v in value.items() if not isinstance(v, str))
    if bad:
        raise ConfigError(f"{where}: the values of {bad} must be strings")
    return {k: Secret(v) for k, v in value.items()}
