"""dsh messages -> OpenAI chat messages and request bodies (pure conversion)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from shared_paths import SHARED_DIR

from pipeline.adapters.llm import (
    DEEPSEEK_DIALECT,
    OPENAI_DIALECT,
    build_chat_body,
    to_openai_messages,
    to_openai_tools,
)
from pipeline.core.errors import ProviderError
from pipeline.core.model import ModelRequest

FIXTURES = (SHARED_DIR / "fixtures")


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"id": "u", "role": "user", "content": list(blocks), "source": {"kind": "user"}}


def assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"id": "a", "role": "assistant", "content": list(blocks),
            "source": {"kind": "model", "provider": "deepseek", "model": "m"}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def reasoning(t: str) -> dict[str, Any]:
    return {"type": "reasoning", "text": t}


def call(call_id: str, name: str = "read", arguments: str = "{}") -> dict[str, Any]:
    return {"type": "tool-call", "id": call_id, "name": name, "arguments": arguments}


def result(call_id: str, t: str, is_error: bool = False) -> dict[str, Any]:
    return {"id": f"r-{call_id}", "role": "user", "source": {"kind": "tool", "callId": call_id},
            "content": [{"type": "tool-result", "toolCallId": call_id, "content": [text(t)],
                         "isError": is_error}]}


def test_text_conversation_with_system_prompt() -> None:
    out = to_openai_messages([user(text("hi"), text("there")), assistant(text("hello"))],
                             system="be brief")
    assert out == [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "hi\nthere"},
                   {"role": "assistant", "content": "hello"}]


def test_tool_calls_and_results_become_tool_calls_and_tool_messages() -> None:
    out = to_openai_messages([
        user(text("read both")),
        assistant(text("ok"), call("c1", arguments='{"p":1}'), call("c2", "ls")),
        result("c1", "one"), result("c2", "boom", is_error=True),
    ])
    assert out[1] == {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    assert out[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "one"},
                       {"role": "tool", "tool_call_id": "c2", "content": "boom"}]


def test_a_user_message_mixing_results_and_text_puts_the_results_first() -> None:
    mixed = user({"type": "tool-result", "toolCallId": "c1", "content": [text("r")]},
                 text("and also"))
    out = to_openai_messages([user(text("go")), assistant(call("c1")), mixed])
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "user"]
    assert out[3] == {"role": "user", "content": "and also"}


def test_reasoning_is_kept_only_where_deepseek_needs_it() -> None:
    conversation = [
        user(text("q1")), assistant(reasoning("plain thought"), text("a1")),
        user(text("q2")), assistant(reasoning("tool thought"), call("c1")), result("c1", "r"),
        assistant(reasoning("after tool"), text("a2")),
        user(text("q3")),
    ]
    deepseek = to_openai_messages(conversation, reasoning_passback="tool-turns")
    carried = [m.get("reasoning_content") for m in deepseek if m["role"] == "assistant"]
    assert carried == [None, "tool thought", "after tool"]
    plain = to_openai_messages(conversation, reasoning_passback="none")
    assert all("reasoning_content" not in m for m in plain)
    everything = to_openai_messages(conversation, reasoning_passback="all")
    assert [m.get("reasoning_content") for m in everything if m["role"] == "assistant"] == [
        "plain thought", "tool thought", "after tool"]


def test_images_become_content_parts_and_unknown_blocks_are_skipped() -> None:
    image = {"type": "image", "attachment": {"mediaType": "image/jpeg", "data": "QUJD"}}
    out = to_openai_messages([user(text("look"), image, {"type": "x-future", "v": 1})])
    assert out == [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}}]}]


def test_source_document_shapes_are_accepted() -> None:
    """seed-example: ``tool_use`` with parsed input and a ``role: tool`` result."""
    derived = json.loads((FIXTURES / "seed-example.derived.json").read_text())
    out = to_openai_messages(derived)
    assert out[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "bash", "arguments": '{"command": "grep ejemplo README.md"}'}}]
    assert out[2] == {"role": "tool", "tool_call_id": "call_1", "content": "ejemplo"}


@pytest.mark.parametrize(("messages", "match"), [
    ([{"role": "system", "content": "x"}], "message 0: unknown role 'system'"),
    (["not an object"], "message 0: a message must be an object"),
    ([user(text("a")), assistant({"type": "tool-call", "id": "c", "name": "f",
                                  "arguments": {"a": 1}})], "message 1: .*raw string"),
    ([user({"type": "tool-result", "content": []})], "message 0: tool-result .*toolCallId"),
    ([{"role": "tool", "content": "orphan"}], "answers no pending tool call"),
])
def test_bad_messages_are_refused_with_where(messages: list[Any], match: str) -> None:
    with pytest.raises(ProviderError, match=match) as info:
        to_openai_messages(messages)
    assert info.value.code == "BAD_REQUEST"


def test_tools_in_dsh_or_openai_shape() -> None:
    schema = {"type": "object", "properties": {"p": {"type": "string"}}}
    native = {"type": "function", "function": {"name": "ls", "parameters": schema}}
    out = to_openai_tools([{"name": "read", "description": "Read a file", "parameters": schema},
                           {"name": "noargs"}, native])
    assert out[0] == {"type": "function", "function": {
        "name": "read", "description": "Read a file", "parameters": schema}}
    assert out[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert out[2] == native
    with pytest.raises(ProviderError, match="tool 0: missing 'name'"):
        to_openai_tools([{"description": "nameless"}])


def test_request_bodies_per_dialect() -> None:
    request = ModelRequest(provider="deepseek", model="deepseek-chat",
                           messages=(user(text("hi")),), system="sys",
                           tools=({"name": "read"},), reasoning_effort="high", max_tokens=99)
    body = build_chat_body(request, DEEPSEEK_DIALECT)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["thinking"] == {"type": "enabled"} and body["reasoning_effort"] == "high"
    assert body["max_tokens"] == 99 and body["tools"][0]["function"]["name"] == "read"
    assert body["messages"][0] == {"role": "system", "content": "sys"}
    off = build_chat_body(ModelRequest(provider="deepseek", model="m", messages=(),
                                       reasoning_effort="none"), DEEPSEEK_DIALECT)
    assert off["thinking"] == {"type": "disabled"} and "reasoning_effort" not in off
    generic = build_chat_body(request, OPENAI_DIALECT)
    assert "thinking" not in generic and generic["reasoning_effort"] == "high"
    plain = build_chat_body(ModelRequest(provider="x", model="m", messages=()), OPENAI_DIALECT)
    assert set(plain) == {"model", "messages", "stream", "stream_options"}
