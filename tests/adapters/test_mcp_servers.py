"""The driver's MCP client against real servers nobody here wrote: server-everything (the
whole protocol), server-filesystem (npm) and mcp-server-git (PyPI), over stdio and
Streamable HTTP; and MCP tools in whole turns (in-memory driver), in parallel and not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp_support import McpServers, child_pids_running, free_port

from pipeline.adapters.llm.scripted import (
    ScriptedProvider,
    ScriptedReply,
    ScriptedToolCall,
    named_tool_script,
)
from pipeline.adapters.mcp import McpServerConnection, ReconnectPolicy, parse_mcp_config
from pipeline.core.inbox import FollowUp
from pipeline.core.turn_effects import SessionConfig, ToolOutcome
from pipeline.services.driver.mcp_tools import McpTools
from pipeline.services.driver.memory import Driver
from pipeline.services.driver.spill import SpilledText, SpillPolicy
from pipeline.services.driver.tools import ECHO, ToolRegistry
from pipeline.settings import MASK

pytestmark = [pytest.mark.mcp, pytest.mark.timeout(180)]

SECRET = "dsh-test-secret-4f1c9a7e"
FAST = ReconnectPolicy(initial_delay_s=0.1, max_delay_s=1.0, max_attempts=20)


@contextlib.asynccontextmanager
async def started(servers: dict[str, Any], *, timeout_s: float = 60.0,
                  policy: ReconnectPolicy | None = None
                  ) -> AsyncIterator[tuple[McpTools, ToolRegistry]]:
    configs = parse_mcp_config({"mcpServers": servers})
    mcp = McpTools([McpServerConnection(c, policy=policy) for c in configs], timeout_s=timeout_s)
    await mcp.start()
    try:
        yield mcp, ToolRegistry([ECHO], sources=[mcp])
    finally:
        await mcp.close()


def text_of(outcome: ToolOutcome) -> str:
    return "".join(str(b["text"]) for b in outcome.content if isinstance(b, dict))


async def eventually(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_everything_tools_have_dshs_names_and_their_schemas_unchanged(
        mcp_servers: McpServers) -> None:
    entry = mcp_servers.everything()
    async with Client(StdioServerParameters(command=entry["command"], args=entry["args"]),
                      mode="legacy") as direct:
        listed = {t.name: t.input_schema for t in (await direct.list_tools()).tools}
    async with started({"everything": entry}) as (mcp, registry):
        definitions = {d["name"]: d for d in registry.definitions()}
        for raw in ("echo", "get-sum", "get-tiny-image", "trigger-long-running-operation"):
            assert definitions[f"mcp__everything__{raw}"]["parameters"] == listed[raw]
        assert "echo" in definitions  # the built-ins stay
        assert all(n == "echo" or n.startswith("mcp__everything__") for n in definitions)
        assert mcp.status() == [{"name": "everything", "transport": "stdio",
                                 "state": "connected", "tools": len(definitions) - 1,
                                 "restarts": 0}]
        # server-everything registers more tools once initialized: notifications/tools/
        # list_changed, and the driver lists them again
        connection = mcp.connections[0]
        await eventually(lambda: connection.tool_lists >= 2)
        assert "mcp__everything__simulate-research-query" in registry.names


async def test_text_image_structured_errors_and_a_hung_call(mcp_servers: McpServers) -> None:
    async with started({"everything": mcp_servers.everything()}, timeout_s=1.0) as (_, tools):
        echo = await tools.run("mcp__everything__echo", '{"message": "hi"}')
        assert (text_of(echo), echo.is_error) == ("Echo: hi", False)
        total = await tools.run("mcp__everything__get-sum", '{"a": 2, "b": 3}')
        assert "5" in text_of(total)
        image = await tools.run("mcp__everything__get-tiny-image", "{}")
        assert "[image: image/png," in text_of(image) and "bytes; not shown" in text_of(image)
        assert len(text_of(image)) < 500  # a note, not base64
        weather = await tools.run("mcp__everything__get-structured-content",
                                  '{"location": "New York"}')
        assert "temperature" in text_of(weather) and not weather.is_error
        bad = await tools.run("mcp__everything__get-sum", '{"a": "two", "b": 3}')
        assert bad.is_error
        started_at = time.monotonic()
        hung = await tools.run("mcp__everything__trigger-long-running-operation",
                               '{"duration": 30, "steps": 3}')
        assert hung.error == {"name": "ToolTimeoutError", "code": "TOOL_TIMEOUT"}
        assert time.monotonic() - started_at < 5
        after = await tools.run("mcp__everything__echo", '{"message": "still here"}')
        assert text_of(after) == "Echo: still here"  # the connection survived the timeout


async def test_a_crashed_server_is_restarted_and_meanwhile_calls_are_error_results(
        mcp_servers: McpServers) -> None:
    # the first restart waits 1 s: time for a call to find the server down
    policy = ReconnectPolicy(initial_delay_s=1.0, max_delay_s=2.0, max_attempts=5)
    async with started({"everything": mcp_servers.everything()}, policy=policy) as (mcp, tools):
        connection = mcp.connections[0]
        [pid] = child_pids_running(mcp_servers.everything_js)
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: connection.state != "connected", 10)
        down = await tools.run("mcp__everything__echo", '{"message": "x"}')
        assert down.is_error and down.error is not None
        assert down.error["name"] == "McpServerError"
        assert down.error["code"] in ("UNAVAILABLE", "CONNECTION_CLOSED")
        await eventually(lambda: connection.state == "connected")
        assert connection.restarts >= 1
        [new_pid] = child_pids_running(mcp_servers.everything_js)
        assert new_pid != pid
        back = await tools.run("mcp__everything__echo", '{"message": "back"}')
        assert text_of(back) == "Echo: back"


async def test_a_server_that_cannot_start_gives_error_results_and_up_after_its_budget(
        tmp_path: pathlib.Path) -> None:
    policy = ReconnectPolicy(initial_delay_s=0.05, max_delay_s=0.1, max_attempts=2)
    missing = str(tmp_path / "no-such-server")
    async with started({"ghost": {"command": missing}}, policy=policy) as (mcp, tools):
        await eventually(lambda: mcp.connections[0].state == "failed", 10)
        assert [n for n in tools.names if n.startswith("mcp__")] == []
        assert mcp.status()[0]["restarts"] == 2


async def test_closing_cuts_a_backoff_wait_short(tmp_path: pathlib.Path) -> None:
    policy = ReconnectPolicy(initial_delay_s=30.0, max_delay_s=30.0, max_attempts=3)
    async with started({"ghost": {"command": str(tmp_path / "nothing")}},
                       policy=policy) as (mcp, tools):
        assert mcp.connections[0].state == "restarting"
        down = await tools.run("mcp__ghost__anything", "{}")
        assert down.error == {"name": "UnknownToolError", "code": "UNKNOWN_TOOL"}
        closing = time.monotonic()
    assert time.monotonic() - closing < 3 and mcp.connections[0].state == "closed"


async def test_env_secrets_stay_out_of_results_status_and_logs(
        mcp_servers: McpServers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    entry = mcp_servers.everything(env={"DSH_TEST_TOKEN": SECRET})
    async with started({"everything": entry}) as (mcp, tools):
        env = await tools.run("mcp__everything__get-env", "{}")
        text = text_of(env)
        assert "DSH_TEST_TOKEN" in text and MASK in text and SECRET not in text
        assert SECRET not in json.dumps(mcp.status()) + repr(mcp.connections[0].config)
    assert SECRET not in caplog.text


async def test_streamable_http_with_secret_headers_and_reconnect(
        mcp_servers: McpServers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()
    server = mcp_servers.start_everything_http(port)
    entry = {"url": f"http://127.0.0.1:{port}/mcp",
             "headers": {"Authorization": f"Bearer {SECRET}"}}
    try:
        async with started({"web": entry}, policy=FAST) as (mcp, tools):
            assert mcp.status()[0]["transport"] == "streamable-http"
            echo = await tools.run("mcp__web__echo", '{"message": "over http"}')
            assert text_of(echo) == "Echo: over http"
            server.kill()
            server.wait()
            down = await tools.run("mcp__web__echo", '{"message": "x"}')
            assert down.is_error and down.error is not None
            assert down.error["name"] == "McpServerError"
            server = mcp_servers.start_everything_http(port)
            await eventually(lambda: mcp.connections[0].restarts >= 1
                             and mcp.connections[0].state == "connected", 30)
            back = await tools.run("mcp__web__echo", '{"message": "again"}')
            assert text_of(back) == "Echo: again"
    finally:
        server.kill()
        server.wait()
    assert SECRET not in caplog.text


class DictStore:
    def __init__(self) -> None:
        self.saved: dict[str, str] = {}

    async def save(self, text: str) -> SpilledText:
        locator = f"mem://{len(self.saved)}"
        self.saved[locator] = text
        return SpilledText(locator, {"locator": locator})


async def test_filesystem_server_reads_writes_refuses_and_large_results_spill(
        mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "notes.txt").write_text("first line\nsecond line\n")
    big = "".join(f"line {n:06d}\n" for n in range(20_000))  # 240,000 bytes
    (root / "big.txt").write_text(big)
    store = DictStore()
    async with started({"files": mcp_servers.filesystem(root)}) as (_, registry):
        tools = registry.with_post_execute(SpillPolicy(
            store.save, inline_bytes=50_000, max_record_bytes=8 * 1024 * 1024).bound)
        listing = await tools.run("mcp__files__list_directory", json.dumps({"path": str(root)}))
        assert "notes.txt" in text_of(listing) and "big.txt" in text_of(listing)
        read = await tools.run("mcp__files__read_text_file",
                               json.dumps({"path": str(root / "notes.txt")}))
        assert text_of(read) == "first line\nsecond line\n"
        wrote = await tools.run("mcp__files__write_file", json.dumps(
            {"path": str(root / "new.txt"), "content": "written by the model"}))
        assert not wrote.is_error and (root / "new.txt").read_text() == "written by the model"
        outside = await tools.run("mcp__files__read_text_file", json.dumps({"path": "/etc/passwd"}))
        assert outside.error == {"name": "McpToolError", "code": "MCP_TOOL_ERROR"}
        assert "denied" in text_of(outside).lower() or "outside" in text_of(outside).lower()
        large = await tools.run("mcp__files__read_text_file",
                                json.dumps({"path": str(root / "big.txt")}))
        assert len(text_of(large).encode()) <= 50_000 and "Omitted" in text_of(large)
        assert store.saved == {"mem://0": big}
        assert isinstance(large.meta, dict) and large.meta["spill"] == {"locator": "mem://0"}


async def test_git_server_over_a_repository_the_test_makes(
        mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=Test", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    (repo / "README.md").write_text("hello\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "the first commit"], check=True)
    (repo / "README.md").write_text("hello, changed\n")
    async with started({"git": mcp_servers.git(repo)}) as (_, tools):
        assert "mcp__git__git_status" in tools.names
        status = await tools.run("mcp__git__git_status", json.dumps({"repo_path": str(repo)}))
        assert "README.md" in text_of(status) and not status.is_error
        log = await tools.run("mcp__git__git_log", json.dumps({"repo_path": str(repo)}))
        assert "the first commit" in text_of(log)
        diff = await tools.run("mcp__git__git_diff_unstaged", json.dumps({"repo_path": str(repo)}))
        assert "+hello, changed" in text_of(diff)


def turn_events(driver: Driver, session: str) -> list[tuple[str, Any]]:
    events = driver.sink.events[session]  # type: ignore[attr-defined]
    return [(e.type, e.data) for e in events if e.type in ("tool/call", "tool/result")]


async def run_turn(tools: ToolRegistry, replies: list[ScriptedReply], session: str = "s1"
                   ) -> tuple[Driver, float]:
    provider = ScriptedProvider.replying(replies)
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=tools,
                    config=SessionConfig("scripted", "m"))
    started_at = time.monotonic()
    driver.submit(FollowUp(session, "m1", ({"type": "text", "text": "go"},)))
    await driver.drain()
    return driver, time.monotonic() - started_at


async def test_parallel_safe_mcp_calls_run_together_and_results_keep_the_models_order(
        mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    slow = '{"duration": 2, "steps": 1}'
    calls = (ScriptedToolCall("mcp__everything__trigger-long-running-operation", slow, "c1"),
             ScriptedToolCall("mcp__everything__echo", '{"message": "quick"}', "c2"),
             ScriptedToolCall("mcp__everything__trigger-long-running-operation", slow, "c3"))
    async with started({"everything": mcp_servers.everything()}) as (_, tools):
        assert all(tools.parallel_safe(c.name) for c in calls)  # readOnlyHint
        driver, took = await run_turn(tools, [ScriptedReply(tool_calls=calls),
                                              ScriptedReply(text="done")])
    events = turn_events(driver, "s1")
    assert [t for t, _ in events] == ["tool/call"] * 3 + ["tool/result"] * 3
    assert [d["message"]["source"]["callId"] for t, d in events if t == "tool/result"] == [
        "c1", "c2", "c3"]  # echo finished first; its result is still logged second
    assert took < 3.5, f"two 2 s calls took {took:.2f} s: not run together"


async def test_parallel_unsafe_mcp_calls_run_one_at_a_time(
        mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    calls = tuple(ScriptedToolCall("mcp__files__write_file", json.dumps(
        {"path": str(tmp_path / f"f{n}.txt"), "content": str(n)}), f"w{n}") for n in range(3))
    async with started({"files": mcp_servers.filesystem(tmp_path)}) as (_, tools):
        assert not tools.parallel_safe("mcp__files__write_file")
        assert tools.parallel_safe("mcp__files__read_text_file")  # annotated read-only
        driver, _ = await run_turn(tools, [ScriptedReply(tool_calls=calls),
                                           ScriptedReply(text="done")])
    assert [t for t, _ in turn_events(driver, "s1")] == ["tool/call", "tool/result"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0.txt", "f1.txt", "f2.txt"]


async def test_a_server_configured_parallel_safe_runs_its_calls_together(
        mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    calls = tuple(ScriptedToolCall("mcp__files__write_file", json.dumps(
        {"path": str(tmp_path / f"f{n}.txt"), "content": str(n)}), f"w{n}") for n in range(2))
    entry = mcp_servers.filesystem(tmp_path, parallelSafe=True)
    async with started({"files": entry}) as (_, tools):
        driver, _ = await run_turn(tools, [ScriptedReply(tool_calls=calls),
                                           ScriptedReply(text="done")])
    assert [t for t, _ in turn_events(driver, "s1")] == ["tool/call"] * 2 + ["tool/result"] * 2


async def test_the_scripted_provider_drives_a_named_mcp_tool(
        mcp_servers: McpServers, tmp_path: pathlib.Path) -> None:
    (tmp_path / "hello.txt").write_text("hello from the filesystem server")
    script = named_tool_script("mcp__files__read_text_file",
                               json.dumps({"path": str(tmp_path / "hello.txt")}))
    async with started({"files": mcp_servers.filesystem(tmp_path)}) as (_, tools):
        provider = ScriptedProvider(script)
        driver = Driver(provider_factory=lambda _p, _m: provider, tools=tools,
                        config=SessionConfig("scripted", "m"))
        driver.submit(FollowUp("s1", "m1", ({"type": "text", "text": "read it"},)))
        await driver.drain()
    last = driver.runners["s1"].log.messages()[-1]
    assert last["role"] == "assistant"
    texts = [b["text"] for b in last["content"] if b["type"] == "text"]
    assert texts == ["Result: hello from the filesystem server"]
