"""An MCP tool call through the driver against the same server called directly with the SDK.

    .venv/bin/python bench/bench_mcp.py [--calls N] [--sessions N]  (one run; prints JSON)
    dsh-pipeline bench --only mcp                        (the suite's figures)

Two processes of ``@modelcontextprotocol/server-everything`` over stdio (``make
mcp-servers`` installs it): one behind the driver's tool path, one called directly with the
``mcp`` SDK's ``Client.call_tool``. Calls to its ``echo`` tool alternate between the two, one
at a time, so both see the same machine; the figures are per-call wall times.

- *through the driver*: ``ToolRegistry.run`` as the session runner awaits it: the raw
  argument string parsed and checked against the tool's schema, the supervised connection,
  the result rendered as a dsh tool result and scrubbed, the spill policy's post-execute;
- *a fleet*: ``sessions`` sessions at once, each a two-step turn calling the MCP echo (one
  server process serves them all), against the same fleet calling the built-in ``echo``:
  steps/s of each, the in-memory driver as bench/bench_runner.py runs it;
- *through a turn*: one step whose model asks for ``calls`` sequential calls (the tool made
  parallel-unsafe), run by the in-memory driver (turn machine, ``tool/call`` and
  ``tool/result`` events appended): the step's tool time per call, against the same number
  of direct calls.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench_runner import TimingSink, follow_up
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters

from pipeline.adapters.llm.scripted import (
    ScriptedProvider,
    ScriptedReply,
    ScriptedToolCall,
    tool_loop_script,
)
from pipeline.adapters.mcp import McpServerConnection, parse_mcp_config
from pipeline.core.inbox import FollowUp
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.mcp_tools import McpTools
from pipeline.services.driver.memory import Driver
from pipeline.services.driver.spill import SpillPolicy
from pipeline.services.driver.tools import ToolRegistry, builtin_registry
from pipeline.settings import Settings

CHECKOUT = Path(__file__).resolve().parent.parent
TOOL = "mcp__everything__echo"
ARGUMENTS = {"message": "hello from the benchmark"}


def everything_command() -> tuple[str, list[str]]:
    """node and server-everything's entry point (installed by make mcp-servers if missing)."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed: the MCP benchmark runs server-everything")
    root = Path(os.environ.get("DSH_CACHE_DIR") or CHECKOUT / ".cache") / "mcp-servers"
    if not (root / ".installed").exists():
        subprocess.run(["make", "--no-print-directory", "mcp-servers"], cwd=CHECKOUT, check=True)
    script = root / "node_modules/@modelcontextprotocol/server-everything/dist/index.js"
    return node, [str(script), "stdio"]


async def driver_tools(command: str, args: list[str], parallel_safe: bool) -> McpTools:
    [config] = parse_mcp_config({"mcpServers": {"everything": {
        "command": command, "args": args, "parallelSafe": parallel_safe}}})
    mcp = McpTools([McpServerConnection(config)])
    await mcp.start()
    return mcp


def spill_policy() -> SpillPolicy:
    """The driver's post-execute at its default sizes (nothing here is large enough to be
    spilled: the policy only measures each result)."""
    settings = Settings()
    return SpillPolicy(None, inline_bytes=settings.spill_inline_bytes,
                       max_record_bytes=settings.max_record_bytes)


def registry_of(mcp: McpTools) -> ToolRegistry:
    """The driver's tool path: the MCP tools, every outcome through the spill policy."""
    return ToolRegistry(sources=[mcp]).with_post_execute(spill_policy().bound)


async def per_call(calls: int, warmup: int = 50) -> dict[str, list[float]]:
    """Per-call ms through the driver's tool path and direct, alternating."""
    command, args = everything_command()
    mcp = await driver_tools(command, args, parallel_safe=True)
    tools = registry_of(mcp)
    raw = json.dumps(ARGUMENTS)
    ours: list[float] = []
    direct: list[float] = []
    try:
        async with Client(StdioServerParameters(command=command, args=args), mode="legacy",
                          cache=None) as client:
            for n in range(warmup + calls):
                started = time.perf_counter()
                outcome = await tools.run(TOOL, raw)
                middle = time.perf_counter()
                result = await client.call_tool("echo", dict(ARGUMENTS))
                ended = time.perf_counter()
                assert not outcome.is_error and not result.is_error, (outcome, result)
                if n >= warmup:
                    ours.append((middle - started) * 1000)
                    direct.append((ended - middle) * 1000)
    finally:
        await mcp.close()
    return {"ours": ours, "direct": direct}


async def per_turn(calls: int) -> dict[str, float]:
    """Mean ms per call of one step of ``calls`` sequential calls, and of as many direct."""
    command, args = everything_command()
    mcp = await driver_tools(command, args, parallel_safe=False)
    # echo is annotated read-only (parallel-safe): the same tool, made sequential here
    spec = dataclasses.replace(mcp.specs()[TOOL], parallel_safe=False)
    tools = ToolRegistry([spec]).with_post_execute(spill_policy().bound)
    reply = ScriptedReply(tool_calls=tuple(
        ScriptedToolCall(TOOL, json.dumps(ARGUMENTS), f"c{n}") for n in range(calls)))
    provider = ScriptedProvider.replying([reply, ScriptedReply(text="done")])
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=tools,
                    config=SessionConfig("scripted", "m"))
    try:
        assert not tools.parallel_safe(TOOL)
        driver.submit(FollowUp("bench", "m1", ({"type": "text", "text": "go"},)))
        await driver.drain()
        events = driver.sink.events["bench"]  # type: ignore[attr-defined]
        calls_at = [e.time for e in events if e.type == "tool/call"]
        results_at = [e.time for e in events if e.type == "tool/result"]
        assert len(calls_at) == len(results_at) == calls
        ours = (results_at[-1] - calls_at[0]) / calls
        async with Client(StdioServerParameters(command=command, args=args), mode="legacy",
                          cache=None) as client:
            started = time.perf_counter()
            for _ in range(calls):
                await client.call_tool("echo", dict(ARGUMENTS))
            direct = (time.perf_counter() - started) * 1000 / calls
    finally:
        await mcp.close()
    return {"ours": ours, "direct": direct}


async def fleet_steps(sessions: int) -> dict[str, float]:
    """Steps/s of ``sessions`` concurrent sessions calling the MCP echo, then the built-in."""
    command, args = everything_command()
    mcp = await driver_tools(command, args, parallel_safe=True)
    tools = builtin_registry()
    tools.add_source(mcp)
    tools = tools.with_post_execute(spill_policy().bound)
    rates = {}
    try:
        for key, name, arguments in (("mcp", TOOL, ARGUMENTS), ("echo", "echo", {"text": "x"})):
            sink = TimingSink()
            provider = ScriptedProvider(tool_loop_script(name, json.dumps(arguments)))
            driver = Driver(provider_factory=lambda _p, _m, p=provider: p, tools=tools,
                            sink=sink, config=SessionConfig("scripted", "bench"))
            started = time.perf_counter()
            for n in range(sessions):
                driver.submit(follow_up(f"s{n}", 0))
            await driver.drain()
            rates[key] = len(sink.step_ms) / (time.perf_counter() - started)
            assert len(sink.step_ms) == 2 * sessions
            failed = [e for events in sink.events.values() for e in events
                      if e.type == "tool/result" and e.data.get("error")]
            assert not failed, failed[0].data
    finally:
        await mcp.close()
    return rates


async def kafka_fleet(bootstrap: str, sessions: int) -> dict[str, float]:
    """Steps/s of the Kafka driver (bench/bench_driver_kafka.py's run, on fresh topics) with
    ``sessions`` sessions each calling the MCP echo, then the built-in echo."""
    import bench_driver_kafka
    # a fresh broker creates its offsets and transaction topics on first use: not measured
    await bench_driver_kafka.run(bootstrap, 20, 6, 25.0)
    command, args = everything_command()
    mcp = await driver_tools(command, args, parallel_safe=True)
    tools = builtin_registry()
    tools.add_source(mcp)
    try:
        ours = await bench_driver_kafka.run(
            bootstrap, sessions, 6, 25.0, tools=tools,
            script=tool_loop_script(TOOL, json.dumps(ARGUMENTS)))
    finally:
        await mcp.close()
    builtin = await bench_driver_kafka.run(bootstrap, sessions, 6, 25.0)
    assert ours["invalid_logs"] == builtin["invalid_logs"] == 0
    return {"mcp": ours["steps_per_s"], "echo": builtin["steps_per_s"]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--bootstrap", help="also run the Kafka driver's fleet on this broker")
    args = parser.parse_args()
    calls = asyncio.run(per_call(args.calls))
    turn = asyncio.run(per_turn(args.calls))
    fleet = asyncio.run(fleet_steps(args.sessions))
    summary: dict[str, Any] = {
        "calls": args.calls,
        "ours_p50_ms": statistics.median(calls["ours"]),
        "direct_p50_ms": statistics.median(calls["direct"]),
        "ours_p99_ms": percentile(calls["ours"], 0.99),
        "direct_p99_ms": percentile(calls["direct"], 0.99),
        "turn_ms_per_call": turn["ours"], "direct_ms_per_call": turn["direct"],
        "fleet_mcp_steps_per_s": fleet["mcp"], "fleet_echo_steps_per_s": fleet["echo"]}
    if args.bootstrap:
        kafka = asyncio.run(kafka_fleet(args.bootstrap, args.sessions))
        summary |= {"kafka_mcp_steps_per_s": kafka["mcp"], "kafka_echo_steps_per_s": kafka["echo"]}
    summary["overhead_p50_ms"] = summary["ours_p50_ms"] - summary["direct_p50_ms"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
