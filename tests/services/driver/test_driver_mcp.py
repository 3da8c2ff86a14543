"""``dsh-pipeline driver --mcp-config`` on a real broker: a fleet whose tools are a real
filesystem server's, driven by ``--script-tool``; /health shows the servers; a session's
tool set is chosen by a configure; the servers' secrets are nowhere in the events, the
status or the driver's output."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import signal
import sys
import urllib.request
from typing import Any

import pytest
from mcp_support import McpServers
from test_driver_configure_crash import follow_up, send, until
from test_driver_crash import driver_env

from pipeline.core.inbox import Configure
from pipeline.settings import Settings

pytestmark = [pytest.mark.broker, pytest.mark.mcp, pytest.mark.timeout(300)]
SECRET = "dsh-driver-secret-9b2e77c1"


async def start(settings: Settings, mcp_config: pathlib.Path, errors: pathlib.Path,
                *args: str) -> tuple[asyncio.subprocess.Process, int]:
    """A driver process, once ready; and the port of its /health."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli.main", "driver", "--grace", "1", "--port", "0",
        "--host", "127.0.0.1", *args,
        env={**driver_env(settings), "DSH_MCP_CONFIG": str(mcp_config)},
        stdout=asyncio.subprocess.PIPE, stderr=errors.open("wb"))
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 90)
    assert line.startswith(b"ready"), f"driver exited early: {line!r} {errors.read_text()}"
    found = re.search(r"status http://127\.0\.0\.1:(\d+)/health", errors.read_text())
    assert found is not None, errors.read_text()
    return process, int(found.group(1))


def offered(events: list[Any]) -> list[str]:
    """The tool names of a session's last request header."""
    [*_, header] = [e.data["header"] for e in events if e.type == "request/header"]
    return [t["name"] for t in header["tools"]]


def health(port: int) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        return json.loads(response.read())


async def test_a_fleet_reads_files_through_an_mcp_server(
        topics: Settings, mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "plan.md").write_text("step 1: read this file through MCP\n")
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "files": mcp_servers.filesystem(root),
        "everything": mcp_servers.everything(env={"DSH_TEST_TOKEN": SECRET})}}))
    errors = tmp_path / "driver.err"
    tool = "mcp__files__read_text_file"
    process, port = await start(topics, config, errors, "--script-tool", tool,
                                "--script-arguments", json.dumps({"path": str(root / "plan.md")}))
    try:
        status = health(port)
        assert {s["name"]: s["state"] for s in status["mcp"]} == {
            "files": "connected", "everything": "connected"}
        await send(topics, Configure("s-chosen", "c-1", tools=(tool, "echo")))
        await send(topics, follow_up("s-all", "f-1", "read the plan"),
                   follow_up("s-chosen", "f-2", "read the plan"))
        logs = await until(topics, lambda logs: all(
            any(e.type == "turn/end" for e in logs.get(s, [])) for s in ("s-all", "s-chosen")),
            "both sessions' turns")
        process.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    for session in ("s-all", "s-chosen"):
        events = logs[session]
        [call] = [e.data for e in events if e.type == "tool/call"]
        assert call["name"] == tool
        [result] = [e.data for e in events if e.type == "tool/result"]
        block = result["message"]["content"][0]
        assert block["isError"] is False
        assert block["content"] == [{"type": "text", "text": "step 1: read this file through "
                                                             "MCP\n"}]
        assert result["meta"] == {"mcp": {"server": "files", "tool": "read_text_file"}}
    chosen, every = (offered(logs[s]) for s in ("s-chosen", "s-all"))
    assert chosen == [tool, "echo"]  # the configure's choice, in its order
    assert {tool, "echo", "mcp__everything__get-env", "mcp__files__write_file"} <= set(every)
    everything = json.dumps([e.data for events in logs.values() for e in events])
    for text in (everything, json.dumps(status), errors.read_text(), out.decode()):
        assert SECRET not in text
