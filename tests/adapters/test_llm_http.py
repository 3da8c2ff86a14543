"""DeepSeek / OpenAI-compatible providers against a local server speaking the real protocol."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import traceback
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from llm_server import (
    LLMTestServer,
    ScriptedResponse,
    chat_chunk,
    error_body,
    tool_call_part,
)
from shared_paths import SHARED_DIR

from pipeline.adapters.llm import (
    DeepSeekProvider,
    OpenAICompatibleProvider,
    ScriptedProvider,
    provider_from_settings,
)
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ConfigError, ProviderError
from pipeline.core.model import Chunk, ModelRequest, assemble
from pipeline.settings import Secret, Settings

KEY = "sk-test-0123456789abcdef-NEVER-LEAK"
FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")
REQUEST = ModelRequest(provider="deepseek", model="deepseek-chat", messages=(
    {"id": "u1", "role": "user", "content": [{"type": "text", "text": "hi"}],
     "source": {"kind": "user"}},))


@pytest.fixture
async def server() -> AsyncIterator[LLMTestServer]:
    test_server = LLMTestServer()
    await test_server.start()
    yield test_server
    await test_server.stop()


@pytest.fixture
async def deepseek(server: LLMTestServer) -> AsyncIterator[DeepSeekProvider]:
    provider = DeepSeekProvider(Secret(KEY), server.base_url, idle_timeout_s=10,
                                trust_env=False)
    yield provider
    await provider.aclose()


async def collect(provider: Any, request: ModelRequest = REQUEST) -> list[Chunk]:
    async with aclosing(provider.stream(request)) as stream:
        return [chunk async for chunk in stream]


async def collect_failure(provider: Any,
                          request: ModelRequest = REQUEST) -> tuple[list[Chunk], ProviderError]:
    chunks: list[Chunk] = []
    with pytest.raises(ProviderError) as info:
        async with aclosing(provider.stream(request)) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    return chunks, info.value


def deepseek_usage(prompt: int, completion: int, hit: int, reasoning: int | None = None
                   ) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion,
                             "prompt_cache_hit_tokens": hit,
                             "prompt_cache_miss_tokens": prompt - hit}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


# --------------------------------------------------------------------------- streams


async def test_text_stream(server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    server.enqueue(ScriptedResponse(events=[
        ": keep-alive\n\n", chat_chunk(content=""), chat_chunk(content="Hel"),
        chat_chunk(content="lo"), chat_chunk(finish_reason="stop",
                                             usage=deepseek_usage(12, 2, 0))]))
    assert await collect(deepseek) == [
        {"type": "block-start", "index": 0, "blockType": "text"},
        {"type": "text-delta", "index": 0, "text": "Hel"},
        {"type": "text-delta", "index": 0, "text": "lo"},
        {"type": "block-end", "index": 0, "block": {"type": "text", "text": "Hello"}},
        {"type": "usage", "usage": {"inputTokens": 12, "outputTokens": 2,
                                    "cacheReadTokens": 0}},
        {"type": "finish", "reason": {"kind": "stop"}}]
    sent = server.requests[0]
    assert sent.path == "/chat/completions"
    assert sent.headers["Authorization"] == f"Bearer {KEY}"
    assert sent.body["stream"] is True and sent.body["model"] == "deepseek-chat"
    assert sent.body["messages"] == [{"role": "user", "content": "hi"}]


def fixture_as_openai_stream(chunks: list[Chunk], usage: dict[str, Any]) -> list[Any]:
    """What DeepSeek sent for a recorded attempt: one SSE event per recorded delta."""
    finish = {"stop": "stop", "tool-calls": "tool_calls"}[chunks[-1]["reason"]["kind"]]
    tool_positions: dict[int, int] = {}
    events: list[Any] = []
    for chunk in chunks:
        if chunk["type"] == "reasoning-delta":
            events.append(chat_chunk(reasoning=chunk["text"], content=""))
        elif chunk["type"] == "text-delta":
            events.append(chat_chunk(content=chunk["text"]))
        elif chunk["type"] == "tool-call-delta":
            first = chunk["index"] not in tool_positions
            position = tool_positions.setdefault(chunk["index"], len(tool_positions))
            events.append(chat_chunk(tool_calls=[tool_call_part(
                position, call_id=chunk["id"] if first else None,
                name=chunk["name"] if first else None, arguments=chunk["argumentsDelta"])]))
    events.append(chat_chunk(content="", finish_reason=finish, usage=usage))
    return events


@pytest.mark.parametrize("name", ["text-turn", "tool-call-turn"])
async def test_recorded_deepseek_turns_stream_back_chunk_for_chunk(
        server: LLMTestServer, deepseek: DeepSeekProvider, name: str) -> None:
    """Reasoning + text, a tool call over 31 deltas, usage with cache hits (2816 cached)."""
    events = read_session_file(FIXTURES / f"{name}.jsonl").events
    by_seq = {e.seq: e.data["chunk"] for e in events if e.type == "assistant/chunk"}
    messages = [e for e in events if e.type == "assistant/message"]
    for message in messages:
        recorded = [by_seq[s] for s in message.source_event_seqs or ()]
        usage = message.data["usage"]
        server.enqueue(ScriptedResponse(events=fixture_as_openai_stream(recorded, {
            **deepseek_usage(usage["inputTokens"] + usage["cacheReadTokens"],
                             usage["outputTokens"], usage["cacheReadTokens"],
                             usage["reasoningTokens"])})))
        assert await collect(deepseek) == recorded
    assert len(server.requests) == len(messages)


async def test_parallel_tool_calls_and_openai_usage(server: LLMTestServer) -> None:
    server.enqueue(ScriptedResponse(events=[
        chat_chunk(content="Reading."),
        chat_chunk(tool_calls=[tool_call_part(0, call_id="call_a", name="read")]),
        chat_chunk(tool_calls=[tool_call_part(0, arguments='{"path":')]),
        chat_chunk(tool_calls=[tool_call_part(1, call_id="call_b", name="ls",
                                              arguments='{"dir"')]),
        chat_chunk(tool_calls=[tool_call_part(0, arguments=' "a.txt"}'),
                               tool_call_part(1, arguments=': "."}')]),
        chat_chunk(finish_reason="tool_calls"),
        chat_chunk(no_choices=True, usage={
            "prompt_tokens": 1000, "completion_tokens": 40,
            "prompt_tokens_details": {"cached_tokens": 768},
            "completion_tokens_details": {"reasoning_tokens": 0}}),
    ]))
    provider = OpenAICompatibleProvider(server.base_url + "/v1", Secret(KEY), trust_env=False)
    try:
        chunks = await collect(provider)
    finally:
        await provider.aclose()
    assert server.requests[0].path == "/v1/chat/completions"
    assert [c["type"] for c in chunks[:3]] == ["block-start", "text-delta", "block-start"]
    assert chunks[-2:] == [
        {"type": "usage", "usage": {"inputTokens": 232, "outputTokens": 40,
                                    "cacheReadTokens": 768, "reasoningTokens": 0}},
        {"type": "finish", "reason": {"kind": "tool-calls"}}]
    deltas = [c for c in chunks if c["type"] == "tool-call-delta"]
    assert {(d["index"], d["id"], d["name"]) for d in deltas} == {
        (1, "call_a", "read"), (2, "call_b", "ls")}
    assert assemble(chunks) == [
        {"type": "text", "text": "Reading."},
        {"type": "tool-call", "id": "call_a", "name": "read", "arguments": '{"path": "a.txt"}'},
        {"type": "tool-call", "id": "call_b", "name": "ls", "arguments": '{"dir": "."}'}]


async def test_tool_calls_without_index_are_told_apart_by_id(
        server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    def part(call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
        entry = tool_call_part(0, call_id=call_id, name=name, arguments=arguments)
        del entry["index"]
        return entry

    server.enqueue(ScriptedResponse(events=[
        chat_chunk(tool_calls=[part("c1", "f", '{"a"')]),
        chat_chunk(tool_calls=[part(None, None, ': 1}')]),
        chat_chunk(tool_calls=[part("c2", "g", "{}")]),
        chat_chunk(finish_reason="stop")]))
    chunks = await collect(deepseek)
    assert [(b["id"], b["arguments"]) for b in assemble(chunks)] == [
        ("c1", '{"a": 1}'), ("c2", "{}")]
    assert chunks[-1] == {"type": "finish", "reason": {"kind": "tool-calls"}}


async def test_crlf_lines_and_a_last_event_without_blank_line(
        server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    last = json.dumps(chat_chunk(finish_reason="length"))
    server.enqueue(ScriptedResponse(done=False, events=[
        f"data: {json.dumps(chat_chunk(content='cut'))}\r\n\r\n", f"data: {last}"]))
    chunks = await collect(deepseek)
    assert chunks[-1] == {"type": "finish", "reason": {"kind": "max-tokens"}}
    assert assemble(chunks) == [{"type": "text", "text": "cut"}]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("status", "message", "headers", "code", "retry_after_ms"), [
    (401, "Authentication Fails", {}, "AUTH", None),
    (403, "forbidden", {}, "AUTH", None),
    (402, "Insufficient Balance", {}, "QUOTA", None),
    (400, "This model's maximum context length is 65536 tokens. However, you requested "
          "70000 tokens", {}, "CONTEXT_WINDOW_EXCEEDED", None),
    (400, "messages[1]: unknown variant `robot`", {}, "BAD_REQUEST", None),
    (404, "model not found", {}, "BAD_REQUEST", None),
    (408, "request timeout", {}, "TIMEOUT", None),
    (429, "Rate limit reached", {"Retry-After": "2"}, "RATE_LIMIT", 2000),
    (429, "Rate limit reached", {"retry-after-ms": "750"}, "RATE_LIMIT", 750),
    (500, "internal error", {}, "SERVER", None),
    (502, "bad gateway", {}, "SERVER", None),
    (503, "Server overloaded", {"Retry-After": "1.5"}, "OVERLOADED", 1500),
    (529, "overloaded", {}, "OVERLOADED", None),
])
async def test_error_statuses_are_mapped(
        server: LLMTestServer, deepseek: DeepSeekProvider, status: int, message: str,
        headers: dict[str, str], code: str, retry_after_ms: int | None) -> None:
    server.enqueue(ScriptedResponse(status=status, body=error_body(message), headers={
        "x-request-id": f"req-{status}", **headers}))
    chunks, error = await collect_failure(deepseek)
    assert chunks == []
    assert (error.code, error.status, error.retry_after_ms) == (code, status, retry_after_ms)
    assert error.request_id == f"req-{status}"
    assert message[:40] in str(error) and f"HTTP {status}" in str(error)
    assert error.retriable == (code in {"RATE_LIMIT", "SERVER", "OVERLOADED", "TIMEOUT"})


async def test_retry_after_as_an_http_date(server: LLMTestServer,
                                           deepseek: DeepSeekProvider) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    server.enqueue(ScriptedResponse(status=429, body=error_body("slow"),
                                    headers={"Retry-After": when}))
    _, error = await collect_failure(deepseek)
    assert error.retry_after_ms is not None and 20_000 < error.retry_after_ms <= 30_000


async def test_stream_torn_mid_way_is_network_after_the_chunks_seen(
        server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    server.enqueue(ScriptedResponse(cut_after=2, events=[
        chat_chunk(content="par"), chat_chunk(content="tial"), chat_chunk(content="never")]))
    chunks, error = await collect_failure(deepseek)
    assert error.code == "NETWORK" and "mid-response" in str(error)
    assert [c.get("text") for c in chunks] == [None, "par", "tial"]


@pytest.mark.parametrize(("events", "done", "code", "match"), [
    ([chat_chunk(content="x")], False, "PROTOCOL", "without a finish_reason"),
    ([chat_chunk(content="x")], True, "PROTOCOL", "without a finish_reason"),
    ([], True, "EMPTY_RESPONSE", "empty stream"),
    (["data: {\"choices\": [oops\n\n"], True, "PROTOCOL", "not JSON: .*oops"),
    (["data: [1, 2]\n\n"], True, "PROTOCOL", "not an object"),
    ([chat_chunk(tool_calls=[tool_call_part(0, name="f")])], True, "PROTOCOL", "without an id"),
    ([chat_chunk(content="x", finish_reason="content_filter")], True, "CONTENT_FILTER",
     "content filter"),
    ([chat_chunk(content="x", finish_reason="insufficient_system_resource")], True,
     "OVERLOADED", "capacity"),
    ([chat_chunk(content="x", finish_reason="eos")], True, "PROTOCOL", "unknown finish"),
    ([chat_chunk(content="x"), {"error": {"message": "upstream died", "type": "server_error"}}],
     True, "SERVER", "mid-stream: upstream died"),
    ([{"error": {"message": "busy", "type": "overloaded_error"}}], True, "OVERLOADED", "busy"),
    ([{"error": {"message": "slow", "code": "rate_limit_exceeded"}}], True, "RATE_LIMIT", "slow"),
    ([chat_chunk(finish_reason="stop", usage={"prompt_tokens": -1})], True, "PROTOCOL",
     "prompt_tokens"),
])
async def test_malformed_streams(server: LLMTestServer, deepseek: DeepSeekProvider,
                                 events: list[Any], done: bool, code: str, match: str) -> None:
    server.enqueue(ScriptedResponse(events=events, done=done,
                                    headers={"x-request-id": "req-bad"}))
    _, error = await collect_failure(deepseek)
    assert error.code == code
    assert error.request_id == "req-bad"
    assert error.status is None
    with pytest.raises(ProviderError, match=match):
        raise error


async def test_a_json_answer_instead_of_a_stream_is_protocol(
        server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    server.enqueue(ScriptedResponse(content_type="application/json", done=False,
                                    events=[error_body("model is warming up")]))
    _, error = await collect_failure(deepseek)
    assert error.code == "PROTOCOL" and "instead of text/event-stream" in str(error)
    assert "model is warming up" in str(error)


async def test_unreachable_endpoint_is_network() -> None:
    idle = LLMTestServer()
    url = await idle.start()
    await idle.stop()  # nothing listens there any more
    provider = OpenAICompatibleProvider(url, connect_timeout_s=5, trust_env=False)
    try:
        _, error = await collect_failure(provider)
    finally:
        await provider.aclose()
    assert error.code == "NETWORK" and url in str(error)


async def test_a_silent_stream_hits_the_idle_timeout(server: LLMTestServer) -> None:
    server.enqueue(ScriptedResponse(hang_after=1, events=[chat_chunk(content="x"),
                                                          chat_chunk(finish_reason="stop")]))
    provider = DeepSeekProvider(Secret(KEY), server.base_url, idle_timeout_s=1.0,
                                trust_env=False)
    try:
        chunks, error = await collect_failure(provider)
    finally:
        await provider.aclose()
    assert error.code == "TIMEOUT" and "waiting for data" in str(error)
    assert assemble(chunks) == [] and len(chunks) == 2


async def test_calls_beyond_the_connection_limit_wait_for_a_free_connection(
        server: LLMTestServer) -> None:
    server.enqueue(*[ScriptedResponse(pause_s=0.01, events=[
        chat_chunk(content=f"answer {i}"), chat_chunk(finish_reason="stop")]) for i in range(3)])
    provider = DeepSeekProvider(Secret(KEY), server.base_url, max_connections=1,
                                trust_env=False)
    try:
        results = await asyncio.gather(*[collect(provider) for _ in range(3)])
    finally:
        await provider.aclose()
    assert sorted(assemble(r)[0]["text"] for r in results) == [
        "answer 0", "answer 1", "answer 2"]


# --------------------------------------------------------------------------- cancellation


async def test_closing_the_iterator_closes_the_http_response(
        server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    server.enqueue(ScriptedResponse(pause_s=0.05, events=[
        chat_chunk(content=f"w{i} ") for i in range(200)] + [chat_chunk(finish_reason="stop")]))
    stream = deepseek.stream(REQUEST)
    first = await anext(stream)
    assert first["type"] == "block-start"
    await stream.aclose()
    await asyncio.wait_for(server.client_gone.wait(), timeout=10)
    # the provider stays usable after a cancelled call
    server.enqueue(ScriptedResponse(events=[chat_chunk(content="ok", finish_reason="stop")]))
    assert assemble(await collect(deepseek)) == [{"type": "text", "text": "ok"}]


async def test_cancelling_the_consuming_task_closes_the_response(
        server: LLMTestServer, deepseek: DeepSeekProvider) -> None:
    server.enqueue(ScriptedResponse(pause_s=0.05, events=[
        chat_chunk(content=f"w{i} ") for i in range(200)]))
    seen = asyncio.Event()

    async def consume() -> None:
        async with aclosing(deepseek.stream(REQUEST)) as stream:
            async for _ in stream:
                seen.set()

    task = asyncio.create_task(consume())
    await seen.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.client_gone.wait(), timeout=10)


# --------------------------------------------------------------------------- the secret


async def test_the_api_key_never_leaks(server: LLMTestServer, deepseek: DeepSeekProvider,
                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, httpx and httpcore included
    server.enqueue(
        ScriptedResponse(status=401, echo_authorization=True),
        ScriptedResponse(events=[f"data: {{\"bad\": \"{KEY}\"\n\n"]),
        ScriptedResponse(events=[chat_chunk(content="x"), {"error": {"message": f"key {KEY}"}}]),
        ScriptedResponse(cut_after=1, events=[chat_chunk(content="x")]),
    )
    errors = [(await collect_failure(deepseek))[1] for _ in range(4)]
    assert [e.code for e in errors] == ["AUTH", "PROTOCOL", "SERVER", "NETWORK"]
    assert KEY in server.requests[0].headers["Authorization"]  # it was really sent
    assert "********" in str(errors[0])  # the echoed key was masked
    for error in errors:
        assert KEY not in str(error) and KEY not in repr(error)
        assert KEY not in "".join(traceback.format_exception(error))
    assert KEY not in repr(deepseek)
    assert caplog.records and KEY not in caplog.text
    assert all(KEY not in str(r.args) for r in caplog.records)


async def test_credentials_in_the_base_url_stay_out_of_errors() -> None:
    idle = LLMTestServer()
    url = await idle.start()
    await idle.stop()
    with_userinfo = url.replace("http://", f"http://user:{KEY}@")
    provider = OpenAICompatibleProvider(with_userinfo, connect_timeout_s=5, trust_env=False)
    try:
        _, error = await collect_failure(provider)
    finally:
        await provider.aclose()
    assert error.code == "NETWORK" and "***@127.0.0.1" in str(error)
    assert KEY not in str(error) and KEY not in repr(provider)


# --------------------------------------------------------------------------- construction


def test_providers_from_settings() -> None:
    scripted = provider_from_settings(Settings(provider="scripted"))
    assert isinstance(scripted, ScriptedProvider)
    with pytest.raises(ConfigError, match="DEEPSEEK_API_KEY") as info:
        provider_from_settings(Settings(provider="deepseek"))
    assert KEY not in str(info.value)
    with pytest.raises(ConfigError, match="unknown model provider 'nope'"):
        provider_from_settings(Settings(), "nope")
    with pytest.raises(ConfigError, match="http"):
        OpenAICompatibleProvider("ftp://example")


async def test_deepseek_from_settings_uses_the_settings_key(server: LLMTestServer) -> None:
    settings = Settings.from_env({"DEEPSEEK_API_KEY": KEY, "DSH_PROVIDER": "deepseek",
                                  "DSH_PROVIDER_BASE_URL": server.base_url})
    provider = provider_from_settings(settings)
    server.enqueue(ScriptedResponse(events=[chat_chunk(content="k", finish_reason="stop")]))
    try:
        await collect(provider)
    finally:
        await provider.aclose()
    assert server.requests[0].headers["Authorization"] == f"Bearer {KEY}"
    assert KEY not in repr(provider)


# --------------------------------------------------------------------------- live (opt-in)


@pytest.mark.skipif(not (os.environ.get("DSH_LIVE_DEEPSEEK") and
                         os.environ.get("DEEPSEEK_API_KEY")),
                    reason="set DSH_LIVE_DEEPSEEK=1 and DEEPSEEK_API_KEY to call the real API")
async def test_live_deepseek_answers_in_dsh_chunks() -> None:
    settings = Settings.from_env()
    provider = provider_from_settings(settings, "deepseek")
    request = ModelRequest(provider="deepseek", model=os.environ.get(
        "DSH_LIVE_MODEL", "deepseek-chat"), messages=REQUEST.messages, max_tokens=64)
    try:
        chunks = await collect(provider, request)
    finally:
        await provider.aclose()
    assert chunks[-1]["type"] == "finish" and chunks[-2]["type"] == "usage"
    assert any(block["type"] == "text" for block in assemble(chunks))
