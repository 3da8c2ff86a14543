"""Approvals in the session runner and the in-memory driver (scripted provider, real tools)."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.adapters.llm.scripted import ScriptedProvider, ScriptedReply, ScriptedToolCall
from pipeline.core.approvals import ApprovalRules
from pipeline.core.events import Event
from pipeline.core.inbox import Approve, FollowUp
from pipeline.core.model import ModelRequest
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import ToolRegistry, ToolSpec, builtin_registry

CONFIG = SessionConfig("scripted", "scripted-1")


def three_calls(request: ModelRequest, attempt: int) -> ScriptedReply:
    """Echo, the gated ``danger``, echo (all parallel-safe but ``danger``), then an answer."""
    if any(isinstance(m, dict) and m.get("role") == "user" and m.get("source", {}).get("kind")
           == "tool" for m in request.messages):
        return ScriptedReply(text="done")
    return ScriptedReply(tool_calls=(ScriptedToolCall("echo", '{"text": "a"}'),
                                     ScriptedToolCall("danger", "{}"),
                                     ScriptedToolCall("echo", '{"text": "b"}')))


def registry(ran: list[str]) -> ToolRegistry:
    async def danger(args: dict[str, Any]) -> str:
        ran.append("danger")
        return "did it"

    tools = builtin_registry()
    tools.register(ToolSpec("danger", "needs a person", {"type": "object"}, danger,
                            parallel_safe=True))
    return tools


def driver(ran: list[str], rules: ApprovalRules) -> Driver:
    provider = ScriptedProvider(three_calls)
    return Driver(provider_factory=lambda _p, _m: provider, tools=registry(ran),
                  config=CONFIG, approvals=rules)


def events(drv: Driver) -> list[Event]:
    assert isinstance(drv.sink, MemorySink)
    return drv.sink.events["s1"]


async def test_the_gated_call_runs_alone_and_later_calls_wait_with_it() -> None:
    ran: list[str] = []
    drv = driver(ran, ApprovalRules(require=("danger",)))
    drv.submit(FollowUp("s1", "m1", ({"type": "text", "text": "go"},)))
    await drv.drain()
    types = [e.type for e in events(drv)]
    assert types[-3:] == ["tool/result", "tool/call", "approval/asked"]  # echo a answered
    assert types.count("tool/call") == 2 and ran == []
    call_id = drv.runners["s1"].machine.waiting_for
    assert call_id is not None and drv.runners["s1"].approval_deadline is None
    drv.submit(Approve("s1", "a1", call_id))
    await drv.drain()
    results = [e.data["message"]["content"][0]["content"][0]["text"]
               for e in events(drv) if e.type == "tool/result"]
    assert results == ["a", "did it", "b"] and ran == ["danger"]  # model order
    assert events(drv)[-1].data["reason"] == {"kind": "completed"}


async def test_the_in_memory_driver_denies_at_the_timeout() -> None:
    ran: list[str] = []
    drv = driver(ran, ApprovalRules(require=("danger",), timeout_ms=50))
    drv.submit(FollowUp("s1", "m1", ({"type": "text", "text": "go"},)))
    await drv.drain()
    assert drv.runners["s1"].machine.waiting_for is not None
    for _ in range(200):
        await asyncio.sleep(0.01)
        await drv.drain()
        if events(drv)[-1].type == "turn/end":
            break
    outcomes = [e.data["outcome"] for e in events(drv) if e.type == "approval/decided"]
    assert outcomes == ["unavailable"] and ran == []
    assert events(drv)[-1].data["reason"] == {"kind": "completed"}
