"""The scripted provider: dsh chunk order, ids, errors, attempts, ready-made scripts."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import pytest

from pipeline.adapters.llm import (
    ModelProvider,
    ScriptedError,
    ScriptedProvider,
    ScriptedReply,
    ScriptedToolCall,
    echo_script,
    tool_loop_script,
)
from pipeline.core.errors import ProviderError
from pipeline.core.model import Chunk, ModelRequest, StreamAccumulator, assemble


def user(text: str, msg_id: str = "u1") -> dict[str, Any]:
    return {"id": msg_id, "role": "user", "content": [{"type": "text", "text": text}],
            "source": {"kind": "user"}}


def request(*messages: dict[str, Any]) -> ModelRequest:
    return ModelRequest(provider="scripted", model="scripted-1",
                        messages=messages or (user("hello"),))


async def collect(provider: ScriptedProvider, req: ModelRequest) -> list[Chunk]:
    async with aclosing(provider.stream(req)) as stream:
        return [chunk async for chunk in stream]


async def failure(provider: ScriptedProvider,
                  req: ModelRequest) -> tuple[list[Chunk], ProviderError]:
    chunks: list[Chunk] = []
    with pytest.raises(ProviderError) as info:
        async with aclosing(provider.stream(req)) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    return chunks, info.value


def fixed(reply: ScriptedReply) -> ScriptedProvider:
    return ScriptedProvider(lambda _request, _attempt: reply)


async def test_a_reply_streams_in_dsh_order() -> None:
    reply = ScriptedReply(reasoning="think", text="answer", pieces=3, tool_calls=(
        ScriptedToolCall("read", '{"path": "a"}'), ScriptedToolCall("ls", "{}", id="mine")))
    chunks = await collect(fixed(reply), request())
    assert [c["type"] for c in chunks] == [
        "block-start", "reasoning-delta", "reasoning-delta", "reasoning-delta",
        "block-start", "text-delta", "text-delta", "text-delta",
        "block-start", "tool-call-delta", "tool-call-delta", "tool-call-delta",
        "block-start", "tool-call-delta", "tool-call-delta",
        "block-end", "block-end", "block-end", "block-end", "usage", "finish"]
    assert assemble(chunks) == [
        {"type": "reasoning", "text": "think"}, {"type": "text", "text": "answer"},
        {"type": "tool-call", "id": "call_1_0", "name": "read", "arguments": '{"path": "a"}'},
        {"type": "tool-call", "id": "mine", "name": "ls", "arguments": "{}"}]
    assert all(c["name"] == "read" for c in chunks if c.get("id") == "call_1_0")
    assert chunks[-1] == {"type": "finish", "reason": {"kind": "tool-calls"}}
    usage = chunks[-2]["usage"]
    assert usage["reasoningTokens"] <= usage["outputTokens"] and usage["cacheReadTokens"] == 0


async def test_tool_call_ids_follow_the_conversation() -> None:
    reply = ScriptedReply(tool_calls=(ScriptedToolCall("f"),))
    earlier = {"id": "a1", "role": "assistant", "content": [{"type": "text", "text": "x"}],
               "source": {"kind": "model"}}
    chunks = await collect(fixed(reply), request(user("a"), earlier, user("b", "u2")))
    assert assemble(chunks)[0]["id"] == "call_2_0"


async def test_finish_and_usage_can_be_scripted() -> None:
    chunks = await collect(fixed(ScriptedReply(text="cut", finish="max-tokens",
                                               usage={"inputTokens": 5, "outputTokens": 1})),
                           request())
    assert chunks[-2:] == [{"type": "usage", "usage": {"inputTokens": 5, "outputTokens": 1}},
                           {"type": "finish", "reason": {"kind": "max-tokens"}}]
    empty = await collect(fixed(ScriptedReply()), request())
    assert [c["type"] for c in empty] == ["usage", "finish"]


async def test_errors_before_and_in_the_middle_of_a_stream() -> None:
    up_front = ScriptedError("RATE_LIMIT", "slow down", status=429, retry_after_ms=1200)
    chunks, error = await failure(fixed(ScriptedReply(text="x", error=up_front)), request())
    assert chunks == []
    assert (error.code, error.status, error.retry_after_ms, str(error)) == (
        "RATE_LIMIT", 429, 1200, "slow down")
    mid = ScriptedReply(text="abcdef", pieces=3, error=ScriptedError("NETWORK", after_chunks=3))
    chunks, error = await failure(fixed(mid), request())
    acc = StreamAccumulator()
    for chunk in chunks:
        acc.add(chunk)
    assert error.code == "NETWORK" and acc.partial_content() == [{"type": "text", "text": "abcd"}]


async def test_attempts_count_calls_of_the_same_request_until_one_succeeds() -> None:
    seen: list[tuple[str, int]] = []

    def flaky(req: ModelRequest, attempt: int) -> ScriptedReply:
        seen.append((req.messages[-1]["id"], attempt))
        if attempt < 3:
            return ScriptedReply(error=ScriptedError("SERVER"))
        return ScriptedReply(text="ok")

    provider = ScriptedProvider(flaky)
    for _ in range(2):
        await failure(provider, request())
    await collect(provider, request())
    await failure(provider, request(user("other", "u9")))  # another request: its own count
    await failure(provider, request())  # the first one succeeded: counting starts again
    assert seen == [("u1", 1), ("u1", 2), ("u1", 3), ("u9", 1), ("u1", 1)]
    assert provider.calls == 5


async def test_replies_in_order_and_a_clear_error_when_they_run_out() -> None:
    provider = ScriptedProvider.replying([ScriptedReply(text="one"), ScriptedReply(text="two")])
    texts = [assemble(await collect(provider, request()))[0]["text"] for _ in range(2)]
    assert texts == ["one", "two"]
    _, error = await failure(provider, request())
    assert error.code == "BAD_REQUEST" and "no reply left after 2" in str(error)


async def test_delays_do_not_change_the_chunks() -> None:
    reply = ScriptedReply(reasoning="r", text="slowly", delay_ms=5, chunk_delay_ms=1)
    quick = ScriptedReply(reasoning="r", text="slowly")
    assert await collect(fixed(reply), request()) == await collect(fixed(quick), request())


def test_without_delays_a_reply_never_suspends() -> None:
    """Cheap for thousands of sessions: every chunk is ready without touching the loop."""
    stream = fixed(ScriptedReply(reasoning="r", text="t")).stream(request())
    chunks = []
    while True:
        step = stream.__anext__()
        try:
            step.send(None)
        except StopIteration as done:
            chunks.append(done.value)
        except StopAsyncIteration:
            break
        else:  # pragma: no cover - it suspended
            step.close()
            pytest.fail("the scripted stream awaited something")
    assert chunks[-1] == {"type": "finish", "reason": {"kind": "stop"}}


async def test_echo_and_tool_loop_scripts() -> None:
    echo = ScriptedProvider(echo_script)
    assert isinstance(echo, ModelProvider)
    assert assemble(await collect(echo, request(user("ping"))))[1] == {
        "type": "text", "text": "Echo: ping"}
    loop = ScriptedProvider(tool_loop_script("echo", '{"text": "hi"}'))
    first = assemble(await collect(loop, request(user("go"))))
    call = first[-1]
    assert (call["type"], call["name"], call["arguments"]) == ("tool-call", "echo",
                                                               '{"text": "hi"}')
    answered = {"id": "r1", "role": "user", "source": {"kind": "tool", "callId": call["id"]},
                "content": [{"type": "tool-result", "toolCallId": call["id"],
                             "content": [{"type": "text", "text": "hi"}]}]}
    assistant = {"id": "a1", "role": "assistant", "content": first, "source": {"kind": "model"}}
    second = assemble(await collect(loop, request(user("go"), assistant, answered)))
    assert second[-1] == {"type": "text", "text": "Done: hi"}
    await loop.aclose()


async def test_named_tool_script_calls_the_tool_once_then_answers_its_result() -> None:
    from pipeline.adapters.llm.scripted import named_tool_script
    from pipeline.core.model import ModelRequest
    script = named_tool_script("mcp__files__read_text_file", '{"path": "/a"}')
    user = {"id": "u1", "role": "user", "content": [{"type": "text", "text": "go"}]}
    first = script(ModelRequest("scripted", "m", (user,)), 1)
    assert [(c.name, c.arguments) for c in first.tool_calls] == [
        ("mcp__files__read_text_file", '{"path": "/a"}')]
    result = {"id": "r1", "role": "user", "content": [
        {"type": "tool-result", "toolCallId": "c", "isError": False,
         "content": [{"type": "text", "text": "x" * 500}]}]}
    answer = script(ModelRequest("scripted", "m", (user, result)), 1)
    assert answer.text == "Result: " + "x" * 500 and not answer.tool_calls
    failed = {**result, "content": [{**result["content"][0], "isError": True}]}
    assert script(ModelRequest("scripted", "m", (user, failed)), 1).text.startswith("Tool error:")
