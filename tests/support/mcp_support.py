"""The third-party MCP servers the tests run, and their mcpServers entries.

``make mcp-servers`` installs them into ``<cache>/mcp-servers`` (``$DSH_CACHE_DIR`` or
``.cache/``): server-everything and server-filesystem with ``npm ci`` from
tests/mcp_servers/package-lock.json, mcp-server-git in a virtualenv of its own. A test that
needs them asks for the ``mcp_servers`` fixture, which installs them when they are missing
(``make test`` has done it already) and skips, saying why, only when node is not installed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DSH_CACHE_DIR") or ROOT / ".cache")


@dataclass(frozen=True)
class McpServers:
    """Where the installed servers are, and their config entries."""

    node: str
    root: pathlib.Path

    @property
    def everything_js(self) -> str:
        return str(self.root / "node_modules/@modelcontextprotocol/server-everything/dist/index.js")

    @property
    def filesystem_js(self) -> str:
        return str(self.root / "node_modules/@modelcontextprotocol/server-filesystem/dist/index.js")

    @property
    def git_command(self) -> str:
        return str(self.root / "git-venv/bin/mcp-server-git")

    def everything(self, **extra: Any) -> dict[str, Any]:
        return {"command": self.node, "args": [self.everything_js, "stdio"], **extra}

    def filesystem(self, *roots: pathlib.Path, **extra: Any) -> dict[str, Any]:
        return {"command": self.node, "args": [self.filesystem_js, *map(str, roots)], **extra}

    def git(self, repository: pathlib.Path, **extra: Any) -> dict[str, Any]:
        return {"command": self.git_command, "args": ["--repository", str(repository)],
                **extra}

    def start_everything_http(self, port: int) -> subprocess.Popen[bytes]:
        """server-everything over Streamable HTTP on ``port`` (at ``/mcp``), once it listens."""
        process = subprocess.Popen([self.node, self.everything_js, "streamableHttp"],
                                   env={**os.environ, "PORT": str(port)},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return process
            time.sleep(0.05)
        process.kill()
        raise RuntimeError(f"server-everything did not listen on {port} within 30 s")


def find_servers() -> McpServers:
    """The installed servers; installs them (make mcp-servers) when missing; skips without
    node."""
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the MCP server tests run "
                    "@modelcontextprotocol/server-everything and server-filesystem")
    root = cache_dir() / "mcp-servers"
    if not (root / ".installed").exists():
        subprocess.run(["make", "--no-print-directory", "mcp-servers"], cwd=ROOT, check=True)
    return McpServers(node, root)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_pids_running(marker: str) -> list[int]:
    """Pids of this process's descendants whose command line contains ``marker``."""
    me = os.getpid()
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == me:
                return True
        return False

    return [pid for pid, command in commands.items() if marker in command and descends(pid)]
