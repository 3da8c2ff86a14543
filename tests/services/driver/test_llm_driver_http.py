"""The in-memory driver running turns through the DeepSeek provider and a local SSE server.

End to end across the provider layer: what the log derives is exactly what reached the wire,
reasoning of a tool turn is passed back as DeepSeek requires, provider failures are logged
with their code/status/request id and retried within the step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from llm_server import LLMTestServer, ScriptedResponse, chat_chunk, error_body, tool_call_part

from pipeline.adapters.llm import DeepSeekProvider, to_openai_messages
from pipeline.core.events import Event
from pipeline.core.inbox import FollowUp
from pipeline.core.log import SessionLog
from pipeline.core.model import RetryPolicy
from pipeline.core.turn_effects import SessionConfig
from pipeline.services.driver.memory import Driver, MemorySink
from pipeline.services.driver.tools import builtin_registry
from pipeline.settings import Secret

SYSTEM = "You are terse."


@pytest.fixture
async def server() -> AsyncIterator[LLMTestServer]:
    test_server = LLMTestServer()
    await test_server.start()
    yield test_server
    await test_server.stop()


async def run_turn(server: LLMTestServer, text: str) -> list[Event]:
    tools = builtin_registry()
    provider = DeepSeekProvider(Secret("sk-e2e"), server.base_url, trust_env=False)
    config = SessionConfig("deepseek", "deepseek-chat", system=SYSTEM,
                           tools=tools.definitions(["echo"]))
    driver = Driver(provider_factory=lambda _p, _m: provider, tools=tools, config=config,
                    retry=RetryPolicy(max_attempts=3, base_ms=1, max_ms=2),
                    jitter=lambda: 0.0)
    try:
        driver.submit(FollowUp("s1", "m1", ({"type": "text", "text": text},)))
        await driver.drain()
    finally:
        await provider.aclose()
    sink = driver.sink
    assert isinstance(sink, MemorySink)
    return sink.events["s1"]


def tool_step() -> ScriptedResponse:
    return ScriptedResponse(events=[
        chat_chunk(reasoning="Use echo.", content=""),
        chat_chunk(tool_calls=[tool_call_part(0, call_id="call_e", name="echo")]),
        chat_chunk(tool_calls=[tool_call_part(0, arguments='{"text": ')]),
        chat_chunk(tool_calls=[tool_call_part(0, arguments='"pong"}')]),
        chat_chunk(finish_reason="tool_calls", usage={
            "prompt_tokens": 300, "completion_tokens": 20, "prompt_cache_hit_tokens": 256,
            "prompt_cache_miss_tokens": 44,
            "completion_tokens_details": {"reasoning_tokens": 3}})])


def answer_step() -> ScriptedResponse:
    return ScriptedResponse(events=[chat_chunk(content="pong"), chat_chunk(
        finish_reason="stop", usage={"prompt_tokens": 330, "completion_tokens": 1})])


def derived_before(events: list[Event], seq: int) -> list[Any]:
    return SessionLog.from_events("s1", [e for e in events if e.seq < seq],
                                  mode="strict").messages()


async def test_a_tool_turn_sends_exactly_what_the_log_derives(server: LLMTestServer) -> None:
    server.enqueue(tool_step(), answer_step())
    events = await run_turn(server, "ping")
    log = SessionLog.from_events("s1", events, mode="strict")
    assert [e for e in events if e.type == "turn/end"][-1].data["reason"] == {
        "kind": "completed"}
    messages = [e for e in events if e.type == "assistant/message"]
    assert messages[0].data["usage"] == {"inputTokens": 44, "outputTokens": 20,
                                         "cacheReadTokens": 256, "reasoningTokens": 3}
    assert messages[1].data["message"]["content"] == [{"type": "text", "text": "pong"}]
    assert len(server.requests) == 2
    for request, message in zip(server.requests, messages, strict=True):
        first_chunk = min(message.source_event_seqs or ())
        assert request.body["messages"] == to_openai_messages(
            derived_before(events, first_chunk), system=SYSTEM,
            reasoning_passback="tool-turns")
        assert request.body["tools"][0]["function"]["name"] == "echo"
    second = server.requests[1].body["messages"]
    assert second[2] == {"role": "assistant", "content": "", "reasoning_content": "Use echo.",
                         "tool_calls": [{"id": "call_e", "type": "function", "function": {
                             "name": "echo", "arguments": '{"text": "pong"}'}}]}
    assert second[3] == {"role": "tool", "tool_call_id": "call_e", "content": "pong"}
    assert [m["role"] for m in log.messages()] == ["user", "assistant", "user", "assistant"]


async def test_a_failed_call_is_logged_and_retried_in_the_step(server: LLMTestServer) -> None:
    server.enqueue(
        ScriptedResponse(status=503, body=error_body("busy", "server_error"),
                         headers={"Retry-After": "0", "x-request-id": "req-503"}),
        ScriptedResponse(cut_after=1, events=[chat_chunk(content="par"),
                                              chat_chunk(content="tial")]),
        answer_step())
    events = await run_turn(server, "ping")
    SessionLog.from_events("s1", events, mode="strict")
    finishes = [e.data["chunk"]["reason"] for e in events if e.type == "assistant/chunk"
                and e.data["chunk"]["type"] == "finish"]
    assert [f["kind"] for f in finishes] == ["error", "error", "stop"]
    assert finishes[0]["failure"]["code"] == "OVERLOADED"
    assert finishes[0]["failure"]["status"] == 503
    assert finishes[0]["failure"]["requestId"] == "req-503"
    assert finishes[0]["failure"]["providerRetryAfterMs"] == 0
    assert finishes[1]["failure"]["code"] == "NETWORK"
    assert [e.type for e in events].count("llm/retry") == 2
    assert [e.type for e in events].count("step/start") == 1
    assert [e for e in events if e.type == "turn/end"][-1].data["reason"] == {
        "kind": "completed"}
    assert "sk-e2e" not in "".join(e.to_line() for e in events)
