"""The session runner and the in-memory driver, with the scripted provider and real tools."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.adapters.llm.scripted import (
    Script,
    ScriptedError,
    ScriptedProvider,
    ScriptedReply,
    ScriptedToolCall,
    tool_loop_script,
)
from pipeline.core.errors import ConfigError, InvariantViolation
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, Configure, FollowUp
from pipeline.core.log import SessionLog
from pipeline.core.model import ModelRequest, RetryPolicy
from pipeline.core.turn_effects import HookDecision, SessionConfig, ToolOutcome
from pipeline.services.driver.hooks import Messages, NextHook, PreStepContext, reject
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.runner import SessionRunner, uuid_id
from pipeline.services.driver.tools import ToolRegistry, ToolSpec, builtin_registry

CONFIG = SessionConfig("scripted", "scripted-1")
FAST_RETRY = RetryPolicy(max_attempts=3, base_ms=1, max_ms=2)


def follow_up(session: str, text: str, message_id: str = "m1") -> FollowUp:
    return FollowUp(session, message_id, ({"type": "text", "text": text},))


def driver_for(script: Script, *, tools: ToolRegistry | None = None, **kwargs: Any) -> Driver:
    provider = ScriptedProvider(script)
    return Driver(provider_factory=lambda _p, _m: provider, tools=tools or builtin_registry(),
                  config=CONFIG, retry=FAST_RETRY, jitter=lambda: 0.0, **kwargs)


def replies(*items: ScriptedReply) -> Script:
    queue = list(items)
    return lambda request, attempt: queue.pop(0)


def events_of(driver: Driver, session: str = "s1") -> list[Event]:
    sink = driver.sink
    assert isinstance(sink, MemorySink)
    return sink.events[session]


def kinds(events: Sequence[Event]) -> list[str]:
    return [e.type for e in events]


def end_reason(events: Sequence[Event]) -> Any:
    return [e for e in events if e.type == "turn/end"][-1].data["reason"]


def strict_log(events: Sequence[Event]) -> SessionLog:
    """Re-fold what the sink received: it must validate and equal the runner's own log."""
    return SessionLog.from_events("s1", events, mode="strict")


async def test_follow_up_runs_a_multi_step_tool_turn() -> None:
    driver = driver_for(tool_loop_script("echo", '{"text": "pong"}'))
    driver.submit(follow_up("s1", "ping"))
    await driver.drain()
    events = events_of(driver)
    assert kinds(events).count("step/start") == 2 and end_reason(events) == {"kind": "completed"}
    result = next(e for e in events if e.type == "tool/result")
    assert result.data["message"]["content"][0]["content"] == [{"type": "text", "text": "pong"}]
    log = strict_log(events)
    assert log.messages() == driver.runners["s1"].log.messages()
    assert [m["role"] for m in log.messages()] == ["user", "assistant", "user", "assistant"]
    sink = driver.sink
    assert isinstance(sink, MemorySink) and sink.flushes["s1"] >= 3


async def test_invalid_arguments_and_unknown_tools_become_error_results() -> None:
    driver = driver_for(replies(
        ScriptedReply(tool_calls=(ScriptedToolCall("echo", '{"text": '),
                                  ScriptedToolCall("rm_rf", "{}"),
                                  ScriptedToolCall("echo", '{"txt": "x"}'))),
        ScriptedReply(text="sorry")))
    driver.submit(follow_up("s1", "go"))
    await driver.drain()
    errors = [e.data["error"]["code"] for e in events_of(driver) if e.type == "tool/result"]
    assert errors == ["INVALID_ARGUMENTS", "UNKNOWN_TOOL", "INVALID_ARGUMENTS"]
    assert end_reason(events_of(driver)) == {"kind": "completed"}
    strict_log(events_of(driver))


class Gate:
    """A tool that signals when it starts and waits to be released (no timing involved)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.running = 0
        self.peak = 0

    async def __call__(self, args: dict[str, Any]) -> ToolOutcome:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.started.set()
        await self.release.wait()
        self.running -= 1
        return ToolOutcome.text(f"gate {args.get('n')}")


def gate_registry(gate: Gate, *, parallel: bool) -> ToolRegistry:
    registry = builtin_registry()
    registry.register(ToolSpec("gate", "waits", {"type": "object"}, gate, timeout_s=60,
                               parallel_safe=parallel))
    return registry


async def test_parallel_safe_calls_run_together_and_log_in_model_order() -> None:
    gate = Gate()
    driver = driver_for(replies(
        ScriptedReply(tool_calls=(ScriptedToolCall("gate", '{"n": 1}'),
                                  ScriptedToolCall("gate", '{"n": 2}'),
                                  ScriptedToolCall("echo", '{"text": "three"}'))),
        ScriptedReply(text="done")), tools=gate_registry(gate, parallel=True))
    driver.submit(follow_up("s1", "go"))
    await gate.started.wait()
    while gate.running < 2:  # both gated calls are in flight before either is released
        await asyncio.sleep(0)
    gate.release.set()
    await driver.drain()
    events = events_of(driver)
    assert gate.peak == 2
    order = [e.data["message"]["source"]["callId"] for e in events if e.type == "tool/result"]
    assert order == ["call_1_0", "call_1_1", "call_1_2"]
    strict_log(events)


async def test_cancel_during_tools_drains_the_started_call() -> None:
    gate = Gate()
    driver = driver_for(replies(
        ScriptedReply(tool_calls=(ScriptedToolCall("gate", '{"n": 1}'),
                                  ScriptedToolCall("echo", '{"text": "never"}')))),
        tools=gate_registry(gate, parallel=False))
    driver.submit(follow_up("s1", "go"))
    await gate.started.wait()
    driver.submit(Cancel("s1", "c1"))
    gate.release.set()
    await driver.drain()
    events = events_of(driver)
    results = [e for e in events if e.type == "tool/result"]
    assert results[0].data["message"]["content"][0]["isError"] is False
    assert results[1].data["error"]["code"] == "TOOL_CANCELED"
    assert kinds(events).count("tool/call") == 1
    assert end_reason(events) == {"kind": "aborted", "reason": {"kind": "user"}}
    strict_log(events)


class ChunkWatch(MemorySink):
    """A sink that signals the first text chunk it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.text_seen = asyncio.Event()

    async def emit(self, session_id: str, events: Sequence[Event]) -> None:
        await super().emit(session_id, events)
        if any(e.type == "assistant/chunk" and e.data["chunk"]["type"] == "text-delta"
               for e in events):
            self.text_seen.set()


async def test_cancel_mid_stream_keeps_what_was_streamed() -> None:
    sink = ChunkWatch()
    driver = driver_for(replies(ScriptedReply(text="a long answer", pieces=13,
                                              chunk_delay_ms=20)), sink=sink)
    driver.submit(follow_up("s1", "go"))
    await sink.text_seen.wait()
    driver.submit(Cancel("s1", "c1", keep_queue=True))
    await driver.drain()
    events = events_of(driver)
    message = next(e for e in events if e.type == "assistant/message")
    assert message.data["interrupted"] is True
    streamed = "".join(e.data["chunk"]["text"] for e in events if e.type == "assistant/chunk"
                       and e.data["chunk"]["type"] == "text-delta")
    assert message.data["message"]["content"] == [{"type": "text", "text": streamed}]
    assert 0 < len(streamed) < len("a long answer")
    assert kinds(events)[-2:] == ["step/end", "turn/end"]
    strict_log(events)


async def test_retry_then_success_and_retries_exhausted() -> None:
    def flaky(request: ModelRequest, attempt: int) -> ScriptedReply:
        if "fail" in str(request.messages[-1]):
            return ScriptedReply(error=ScriptedError("SERVER", status=503))
        if attempt == 1:
            return ScriptedReply(text="x", error=ScriptedError("RATE_LIMIT", after_chunks=2))
        return ScriptedReply(text="ok")

    driver = driver_for(flaky)
    driver.submit(follow_up("s1", "go"))
    await driver.drain()
    first = list(events_of(driver))
    assert kinds(first).count("llm/retry") == 1 and end_reason(first) == {"kind": "completed"}
    driver.submit(follow_up("s1", "fail", "m2"))
    await driver.drain()
    second = events_of(driver)[len(first):]
    assert kinds(second).count("llm/retry") == 2  # 3 attempts in all
    assert end_reason(second)["error"]["code"] == "SERVER"
    strict_log(events_of(driver))


async def test_a_rejecting_hook_blocks_the_turn() -> None:
    async def gatekeeper(context: PreStepContext, messages: Messages,
                         next: NextHook) -> HookDecision:
        if "forbidden" in str(messages):
            return reject("policy")
        return await next(messages)

    driver = driver_for(replies(ScriptedReply(text="fine")), hooks=[gatekeeper])
    driver.submit(follow_up("s1", "forbidden words"))
    driver.submit(follow_up("s1", "fine words", "m2"))
    await driver.drain()
    events = events_of(driver)
    reasons = [e.data["reason"]["kind"] for e in events if e.type == "turn/end"]
    assert reasons == ["blocked", "completed"]


async def test_configure_sets_model_and_tools_in_the_header() -> None:
    seen: list[ModelRequest] = []

    def script(request: ModelRequest, attempt: int) -> ScriptedReply:
        seen.append(request)
        return ScriptedReply(text="ok")

    driver = driver_for(script)
    driver.submit(Configure("s1", "cfg", model="scripted-2", tools=("echo",),
                            system="be brief"))
    with pytest.raises(ConfigError, match="unknown tools"):
        driver.submit(Configure("s1", "cfg2", tools=("bash",)))  # host tools are off
    driver.submit(follow_up("s1", "hi"))
    await driver.drain()
    header = next(e for e in events_of(driver) if e.type == "request/header").data["header"]
    assert header["config"] == {"provider": "scripted", "model": "scripted-2"}
    assert [t["name"] for t in header["tools"]] == ["echo"] and header["system"] == "be brief"
    assert seen[0].tools == tuple(header["tools"]) and seen[0].model == "scripted-2"


async def test_a_corrupted_request_fails_loudly() -> None:
    def corrupt(request: ModelRequest) -> ModelRequest:
        return ModelRequest(request.provider, request.model, request.messages[:-1],
                            request.system, request.tools)

    runner = SessionRunner(SessionLog("s1"), provider_factory=lambda _p, _m: ScriptedProvider(
        replies(ScriptedReply(text="never"))), tools=builtin_registry(), sink=MemorySink(),
        config=CONFIG, request_check=corrupt)
    runner.submit(follow_up("s1", "hi"))
    with pytest.raises(InvariantViolation, match="messages"):
        await runner.run_until_idle()
    assert "assistant/chunk" not in kinds(runner.log.events)  # the provider was never called


async def test_recover_closes_an_open_turn_before_anything_else() -> None:
    driver = driver_for(tool_loop_script("echo", '{"text": "x"}'))
    driver.submit(follow_up("s1", "go"))
    await driver.drain()
    events = events_of(driver)
    crash_at = next(e.seq for e in events if e.type == "tool/call") + 1  # result never written
    sink = MemorySink()
    runner = SessionRunner(SessionLog.from_events("s1", events[:crash_at]),
                           provider_factory=lambda _p, _m: ScriptedProvider(
                               tool_loop_script("echo", "{}")),
                           tools=builtin_registry(), sink=sink, config=CONFIG)
    await runner.recover()
    closers = sink.events["s1"]
    assert kinds(closers) == ["tool/result", "step/end", "turn/end"]
    assert closers[0].data["error"]["code"] == "TOOL_OUTCOME_UNKNOWN"
    await runner.recover()  # idempotent
    assert len(sink.events["s1"]) == 3 and not runner.busy


async def test_many_sessions_run_concurrently_and_all_validate() -> None:
    driver = driver_for(tool_loop_script("echo", '{"text": "x"}'))
    sessions = [f"s{i}" for i in range(50)]
    for session in sessions:
        driver.submit(follow_up(session, f"hello {session}"))
    await driver.drain()
    for session in sessions:
        log = SessionLog.from_events(session, events_of(driver, session), mode="strict")
        assert log.turn.last_end_reason == {"kind": "completed"}
        assert len(log.messages()) == 4


async def test_dispose_aborts_the_open_turn_and_leaves_the_queue() -> None:
    gate = Gate()
    driver = driver_for(replies(ScriptedReply(tool_calls=(ScriptedToolCall("gate", "{}"),))),
                        tools=gate_registry(gate, parallel=False))
    driver.submit(follow_up("s1", "go"))
    await gate.started.wait()
    driver.submit(follow_up("s1", "later", "m2"))
    runner = driver.runners["s1"]
    disposing = asyncio.ensure_future(runner.dispose())
    gate.release.set()
    await disposing
    await driver.drain()
    events = events_of(driver)
    assert end_reason(events) == {"kind": "aborted", "reason": {"kind": "disposed"}}
    assert kinds(events).count("turn/start") == 1  # the queued follow-up did not start
    assert len(strict_log(events).turn.open_calls) == 0
    assert len(runner.machine.inbox.next_turn) == 1


async def test_an_unknown_provider_ends_the_turn_with_a_config_error() -> None:
    def factory(provider: str, model: str) -> ScriptedProvider:
        if provider != "scripted":
            raise ConfigError(f"no provider named {provider!r}")
        return ScriptedProvider(replies(ScriptedReply(text="ok")))

    driver = Driver(provider_factory=factory, tools=builtin_registry(), config=CONFIG)
    driver.submit(Configure("s1", "c1", provider="elsewhere"))
    driver.submit(follow_up("s1", "hi"))
    await driver.drain()
    events = events_of(driver)
    assert end_reason(events)["error"]["code"] == "CONFIG"
    header = next(e for e in events if e.type == "request/header").data["header"]
    assert [t["name"] for t in header["tools"]] == ["clock", "echo", "sleep"]  # the default


async def test_every_event_the_runner_writes_survives_the_avro_codec() -> None:
    from pipeline.codec.avro import EventSerde

    def script(request: ModelRequest, attempt: int) -> ScriptedReply:
        if attempt == 1:
            return ScriptedReply(text="x", error=ScriptedError("SERVER", after_chunks=2))
        if len(request.messages) == 1:
            return ScriptedReply(reasoning="think", tool_calls=(
                ScriptedToolCall("echo", '{"text": "é"}'), ScriptedToolCall("nope", "{")))
        return ScriptedReply(text="done", finish="max-tokens")

    driver = driver_for(script)
    driver.submit(Configure("s1", "c", system="sys", reasoning_effort="high", max_tokens=9))
    driver.submit(FollowUp("s1", "m1", TEXT_BLOCKS, source={"kind": "api", "n": None}))
    await driver.drain()
    events = events_of(driver)
    serde = EventSerde()
    for event in events:
        assert serde.decode(serde.encode("s1", event)) == ("s1", event), event.type
    assert {"llm/retry", "llm/retry-started", "request/header", "request/context",
            "agent/inbox/spliced", "tool/call", "tool/result"} <= set(kinds(events))


TEXT_BLOCKS = ({"type": "text", "text": "go"},)


async def test_a_claim_is_emitted_together_with_the_messages_it_claims() -> None:
    class Batches(MemorySink):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[list[str]] = []

        async def emit(self, session_id: str, events: Sequence[Event]) -> None:
            await super().emit(session_id, events)
            self.batches.append([e.type for e in events])

    sink = Batches()
    driver = driver_for(replies(ScriptedReply(text="ok")), sink=sink)
    driver.submit(follow_up("s1", "hi"))
    await driver.drain()
    claim_batch = next(b for b in sink.batches if "turn/start" in b)
    start = claim_batch.index("turn/start")
    assert claim_batch[start:start + 4] == ["turn/start", "agent/inbox/spliced", "step/start",
                                            "user/message"]


async def test_step_limit_hook_stops_a_tool_loop() -> None:
    from pipeline.services.driver.hooks import step_limit

    def forever(request: ModelRequest, attempt: int) -> ScriptedReply:
        return ScriptedReply(tool_calls=(ScriptedToolCall("echo", '{"text": "again"}'),))

    driver = driver_for(forever, hooks=[step_limit(3)])
    driver.submit(follow_up("s1", "loop"))
    await driver.drain()
    events = events_of(driver)
    assert kinds(events).count("step/start") == 3
    assert end_reason(events) == {"kind": "aborted", "reason": {
        "kind": "hook", "reason": "step limit 3 reached"}}
    with pytest.raises(ConfigError):
        step_limit(0)


def test_uuid_ids_are_version_4_uuids_in_canonical_form_and_differ() -> None:
    ids = [uuid_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for text in ids[:200]:
        parsed = uuid.UUID(text)
        assert str(parsed) == text
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122


async def test_cancelling_the_runner_mid_stream_stops_it_and_is_not_a_cancel_command() -> None:
    """Shutdown cancels the run loop itself: the stream stops, no turn/end is written (the
    next owner repairs the turn), and the loop does not carry on as after a cancel command."""
    sink = ChunkWatch()
    driver = driver_for(replies(ScriptedReply(text="a long answer", pieces=13,
                                              chunk_delay_ms=20)), sink=sink)
    driver.submit(follow_up("s1", "go"))
    await sink.text_seen.wait()
    (run_loop,) = driver._tasks.values()
    run_loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run_loop, 30)
    assert "turn/end" not in kinds(events_of(driver))
    assert driver.runners["s1"].machine.turn == 1
    assert not driver.runners["s1"]._lock.locked()
