"""The pure parts of the HTTP providers: SSE decoding, delta translation, usage, Retry-After."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llm_server import chat_chunk, tool_call_part

from pipeline.adapters.llm.http_provider import parse_retry_after_ms, request_id_of
from pipeline.adapters.llm.openai_stream import ChatStreamTranslator, SSEDecoder, map_usage
from pipeline.core.errors import ProviderError
from pipeline.core.model import Chunk, StreamAccumulator


def decode(lines: list[str]) -> list[str]:
    decoder = SSEDecoder()
    events = [data for line in lines if (data := decoder.feed_line(line)) is not None]
    tail = decoder.flush()
    return events + ([tail] if tail is not None else [])


def test_sse_decoding_follows_the_standard() -> None:
    assert decode([": keep-alive", "", "data: a", "", "data:b", "data:  c", "",
                   "event: message", "id: 7", "retry: 10", "data: d", "", "", "data: e"]) == [
        "a", "b\n c", "d", "e"]


def split_points(text: str) -> st.SearchStrategy[list[str]]:
    """``text`` cut into 1..n consecutive non-empty pieces."""
    if len(text) <= 1:
        return st.just([text])
    return st.sets(st.integers(1, len(text) - 1), max_size=8).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)],
                                               strict=True)])


answer_parts = st.tuples(st.text(max_size=30), st.text(max_size=30),
                         st.lists(st.text(min_size=1, max_size=20), max_size=3))


@st.composite
def streamed_answers(draw: st.DrawFn) -> tuple[str, str, list[str], list[dict[str, Any]]]:
    reasoning, text, arguments = draw(answer_parts)
    payloads: list[dict[str, Any]] = []
    for piece in draw(split_points(reasoning)) if reasoning else []:
        payloads.append(chat_chunk(reasoning=piece, content=""))
    for piece in draw(split_points(text)) if text else []:
        payloads.append(chat_chunk(content=piece))
    for position, args in enumerate(arguments):
        pieces = draw(split_points(args))
        payloads.append(chat_chunk(tool_calls=[tool_call_part(
            position, call_id=f"c{position}", name="f", arguments=pieces[0])]))
        payloads.extend(chat_chunk(tool_calls=[tool_call_part(position, arguments=p)])
                        for p in pieces[1:])
    payloads.append(chat_chunk(finish_reason="tool_calls" if arguments else "stop"))
    return reasoning, text, arguments, payloads


def translate(payloads: list[dict[str, Any]]) -> list[Chunk]:
    translator = ChatStreamTranslator()
    chunks = [c for p in payloads for c in translator.feed(json.dumps(p))]
    return chunks + translator.end()


@settings(max_examples=150, deadline=None)
@given(streamed_answers())
def test_any_split_of_an_answer_assembles_to_the_whole(
        answer: tuple[str, str, list[str], list[dict[str, Any]]]) -> None:
    reasoning, text, arguments, payloads = answer
    chunks = translate(payloads)
    started: list[int] = []
    for chunk in chunks:  # every delta belongs to a block started before it
        if chunk["type"] == "block-start":
            started.append(chunk["index"])
        elif "index" in chunk and chunk["type"] != "block-end":
            assert chunk["index"] in started
    assert started == list(range(len(started)))
    ends = [c["index"] for c in chunks if c["type"] == "block-end"]
    assert ends == started and chunks[-1]["type"] == "finish"
    acc = StreamAccumulator()
    for chunk in chunks:
        acc.add(chunk)
    expected = ([{"type": "reasoning", "text": reasoning}] if reasoning else []) + (
        [{"type": "text", "text": text}] if text else []) + [
        {"type": "tool-call", "id": f"c{i}", "name": "f", "arguments": a}
        for i, a in enumerate(arguments)]
    assert acc.content() == expected
    assert acc.finish_kind == ("tool-calls" if arguments else "stop")


def test_null_fields_of_lenient_servers_are_ignored() -> None:
    translator = ChatStreamTranslator()
    payload = chat_chunk(content="a", finish_reason="")
    payload["error"] = None
    payload["choices"][0]["delta"].update(reasoning_content=None, reasoning="r", tool_calls=None)
    assert [c["type"] for c in translator.feed(json.dumps(payload))] == [
        "block-start", "reasoning-delta", "block-start", "text-delta"]
    assert not translator.finished


@pytest.mark.parametrize(("raw", "usage"), [
    ({"prompt_tokens": 2986, "completion_tokens": 28, "prompt_cache_hit_tokens": 2816,
      "prompt_cache_miss_tokens": 170, "completion_tokens_details": {"reasoning_tokens": 25}},
     {"inputTokens": 170, "outputTokens": 28, "cacheReadTokens": 2816, "reasoningTokens": 25}),
    ({"prompt_tokens": 100, "completion_tokens": 5,
      "prompt_tokens_details": {"cached_tokens": 64}},
     {"inputTokens": 36, "outputTokens": 5, "cacheReadTokens": 64}),
    ({"prompt_tokens": 100, "completion_tokens": 5,
      "prompt_tokens_details": {"cached_tokens": 10, "cache_write_tokens": 50}},
     {"inputTokens": 40, "outputTokens": 5, "cacheReadTokens": 10, "cacheWriteTokens": 50}),
    ({"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": None},
     {"inputTokens": 9, "outputTokens": 1}),
    ({}, {"inputTokens": 0, "outputTokens": 0}),
])
def test_usage_mapping_makes_counts_disjoint(raw: dict[str, Any], usage: dict[str, int]) -> None:
    assert map_usage(raw) == usage


@pytest.mark.parametrize("raw", [{"prompt_tokens": "9"}, {"completion_tokens": 1.5},
                                 {"prompt_cache_hit_tokens": True}])
def test_usage_with_bad_counts_is_a_protocol_error(raw: dict[str, Any]) -> None:
    with pytest.raises(ProviderError, match="usage") as info:
        map_usage(raw)
    assert info.value.code == "PROTOCOL"


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, None),
    ({"retry-after": "3"}, 3000),
    ({"retry-after": "0.25"}, 250),
    ({"retry-after": "-4"}, 0),
    ({"retry-after-ms": "120", "retry-after": "9"}, 120),
    ({"retry-after-ms": "soon", "retry-after": "2"}, 2000),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, 10_000),
    ({"retry-after": "Wed, 21 Oct 2015 07:27:00 GMT"}, 0),  # already past
    ({"retry-after": "whenever"}, None),
])
def test_retry_after_parsing(headers: dict[str, str], expected: int | None) -> None:
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert parse_retry_after_ms(headers, now) == expected


def test_request_id_header_preference() -> None:
    assert request_id_of({"request-id": "b", "x-request-id": "a"}) == "a"
    assert request_id_of({"cf-ray": "r"}) == "r"
    assert request_id_of({}) is None
