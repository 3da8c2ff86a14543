"""The suite's MCP figures (issue 32): a tool call through the driver against the same
server called directly with the ``mcp`` SDK (bench/bench_mcp.py measures)."""

from __future__ import annotations

import asyncio
import statistics

import bench_mcp
from suite_core import Context, Figure

SERVER = "server-everything's echo over stdio"


def bench_mcp_call(ctx: Context) -> list[Figure]:
    calls = ctx.size(1000, 50)
    direct = ("the same server (another process of it) called directly: mcp SDK Client.call_tool")
    tool_path = Figure(f"MCP tool call p50, driver's tool path ({SERVER})", "ms", [], direct,
                       higher_is_better=False, worst_counts=True)
    overhead = Figure("MCP tool call: overhead p50 of the driver's tool path over the direct "
                      "call", "ms", [], higher_is_better=False, worst_counts=True,
                      goal="<= 5 ms (issue 32)")
    turn = Figure(f"MCP tool call in a turn: ms per call, {calls:,} sequential calls in one "
                  "step", "ms", [], direct, higher_is_better=False, worst_counts=True)
    turn_overhead = Figure("MCP tool call in a turn: overhead per call over the direct call",
                           "ms", [], higher_is_better=False, worst_counts=True,
                           goal="<= 5 ms (issue 32)")
    for _ in range(ctx.latency_runs):
        measured = asyncio.run(bench_mcp.per_call(calls))
        ours, theirs = (statistics.median(measured[k]) for k in ("ours", "direct"))
        tool_path.ours.append(ours)
        tool_path.anchor_values.append(theirs)
        overhead.ours.append(ours - theirs)
        in_turn = asyncio.run(bench_mcp.per_turn(calls))
        turn.ours.append(in_turn["ours"])
        turn.anchor_values.append(in_turn["direct"])
        turn_overhead.ours.append(in_turn["ours"] - in_turn["direct"])
    overhead.judge(5.0)
    turn_overhead.judge(5.0)
    tool_path.note = overhead.note = (
        f"{calls:,} calls per run after 50 of warm-up, alternating one by one between the "
        "driver's tool path (ToolRegistry.run: arguments parsed and checked against the "
        "schema, the supervised connection, the result rendered and scrubbed, the spill "
        "policy) and the direct SDK call; p50 of each per run (bench/bench_mcp.py)")
    turn.note = turn_overhead.note = (
        "one in-memory driver step whose model asks for the calls (the tool made "
        "parallel-unsafe, so they run one at a time): first tool/call to last tool/result "
        "event time (ms clock) per call, turn machine and event appends included; then as "
        "many direct SDK calls")
    return [tool_path, overhead, turn, turn_overhead, *_fleet(ctx)]


def _fleet(ctx: Context) -> list[Figure]:
    sessions = ctx.size(1000, 50)
    steps = Figure(f"MCP fleet: steps/s, {sessions:,} concurrent sessions each calling the MCP "
                   "echo", "steps/s", [], "the same fleet calling the built-in echo tool")
    share = Figure("MCP fleet: steps/s against the built-in echo's", "x", [],
                   goal=">= 0.8x (issue 32)")
    for _ in range(ctx.runs):
        rates = asyncio.run(bench_mcp.fleet_steps(sessions))
        steps.ours.append(rates["mcp"])
        steps.anchor_values.append(rates["echo"])
        share.ours.append(rates["mcp"] / rates["echo"])
    share.judge(0.8)
    steps.note = share.note = (
        "in-memory driver (bench/bench_runner.py's sink and follow-ups), scripted provider: "
        "each session one two-step turn (the tool call, then the answer); one "
        "server-everything process serves every session's call over one stdio connection; "
        "the MCP run first, then the built-in one, in each run")
    return [steps, share, *_kafka_fleet(ctx)]


def _kafka_fleet(ctx: Context) -> list[Figure]:
    sessions = ctx.size(1000, 50)
    steps = Figure(f"MCP fleet over Kafka: steps/s, {sessions:,} sessions each calling the MCP "
                   "echo", "steps/s", [], "the same fleet calling the built-in echo tool")
    share = Figure("MCP fleet over Kafka: steps/s against the built-in echo's", "x", [],
                   goal=">= 0.8x (issue 32)")
    for _ in range(ctx.runs):
        rates = asyncio.run(bench_mcp.kafka_fleet(ctx.bootstrap, sessions))
        steps.ours.append(rates["mcp"])
        steps.anchor_values.append(rates["echo"])
        share.ours.append(rates["mcp"] / rates["echo"])
    share.judge(0.8)
    steps.note = share.note = (
        "the Kafka driver in this process as bench/bench_driver_kafka.py runs it (6 "
        "partitions, linger 25 ms, a burst of one follow-up per session, steps counted by a "
        "read-committed reader in a process of its own), one server-everything process for "
        "every session's call; the MCP run first, then the built-in one, on fresh topics")
    return [steps, share]
