"""OpenAI/DeepSeek streaming ``/chat/completions`` -> dsh chunks (pure, no I/O).

:class:`SSEDecoder` turns the lines of a ``text/event-stream`` body into event payloads;
:class:`ChatStreamTranslator` turns each decoded ``chat.completion.chunk`` into dsh chunks.
Blocks are numbered in the order they first appear (reasoning, text, each tool call by its
OpenAI ``index``) and all end together when the stream ends, in index order, followed by
``usage`` (when the server sent it) and ``finish``: the order dsh itself records.

Malformed input raises :class:`ProviderError` with code ``PROTOCOL``; a finish reason that
means the provider failed (``content_filter``, DeepSeek's ``insufficient_system_resource``)
raises the matching code after the content streamed so far.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pipeline.core.errors import ProviderError
from pipeline.core.model import (
    Block,
    Chunk,
    block_end,
    block_start,
    finish_chunk,
    make_usage,
    reasoning_delta,
    text_delta,
    tool_call_delta,
    usage_chunk,
)

DONE: Final = "[DONE]"
FINISH_REASONS: Final = {
    "stop": "stop", "tool_calls": "tool-calls", "function_call": "tool-calls",
    "length": "max-tokens",
}
FAILED_FINISH_REASONS: Final = {
    "content_filter": ("CONTENT_FILTER", "the provider's content filter stopped the answer"),
    "insufficient_system_resource": ("OVERLOADED", "the provider ran out of capacity mid-answer"),
}
STREAM_ERROR_CODES: Final = (("rate_limit", "RATE_LIMIT"), ("overload", "OVERLOADED"),
                              ("context_length", "CONTEXT_WINDOW_EXCEEDED"))
EXCERPT_CHARS: Final = 200


def protocol_error(message: str, *, request_id: str | None = None) -> ProviderError:
    return ProviderError(f"malformed stream: {message}", code="PROTOCOL", request_id=request_id)


def excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."


class SSEDecoder:
    """Server-sent events, line by line: returns each event's ``data`` when it completes.

    Comment lines (``: keep-alive``) and fields other than ``data`` are ignored; several
    ``data`` lines of one event are joined with newlines, as the SSE standard says.
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, line: str) -> str | None:
        if line == "":
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data (at a blank line or the end of the body), if any."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def _count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise protocol_error(f"usage.{name} must be a non-negative integer, got {value!r}")
    return value


def map_usage(raw: Mapping[str, Any]) -> dict[str, int]:
    """OpenAI/DeepSeek usage -> dsh usage, whose input count excludes cached input.

    DeepSeek reports ``prompt_cache_hit_tokens``/``prompt_cache_miss_tokens``; OpenAI
    reports ``prompt_tokens_details.cached_tokens`` (part of ``prompt_tokens``).
    """
    prompt = _count(raw.get("prompt_tokens"), "prompt_tokens") or 0
    completion = _count(raw.get("completion_tokens"), "completion_tokens") or 0
    details = raw.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    hit = _count(raw.get("prompt_cache_hit_tokens"), "prompt_cache_hit_tokens")
    if hit is None:
        hit = _count(details.get("cached_tokens"), "prompt_tokens_details.cached_tokens")
    written = _count(details.get("cache_write_tokens"), "prompt_tokens_details.cache_write_tokens")
    miss = _count(raw.get("prompt_cache_miss_tokens"), "prompt_cache_miss_tokens")
    input_tokens = miss if miss is not None else max(0, prompt - (hit or 0) - (written or 0))
    completion_details = raw.get("completion_tokens_details")
    reasoning = None
    if isinstance(completion_details, dict):
        reasoning = _count(completion_details.get("reasoning_tokens"),
                           "completion_tokens_details.reasoning_tokens")
    return make_usage(input_tokens=input_tokens, output_tokens=completion, cache_read_tokens=hit,
                      cache_write_tokens=written, reasoning_tokens=reasoning)


@dataclass(slots=True)
class _ToolBlock:
    index: int
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ChatStreamTranslator:
    """State of one streamed answer: feed each decoded payload, then call :meth:`end`."""

    __slots__ = ("_blocks", "_finish_reason", "_next_index", "_reasoning", "_request_id",
                 "_text", "_tools", "_usage", "payload_count")

    def __init__(self, request_id: str | None = None) -> None:
        self._request_id = request_id
        self._next_index = 0
        self._reasoning: tuple[int, list[str]] | None = None
        self._text: tuple[int, list[str]] | None = None
        self._tools: dict[int, _ToolBlock] = {}  # by OpenAI tool_calls index
        self._blocks: list[int] = []  # dsh indexes in opening order (== index order)
        self._finish_reason: str | None = None
        self._usage: dict[str, int] | None = None
        self.payload_count = 0

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    def feed(self, data: str) -> list[Chunk]:
        """The dsh chunks for one SSE ``data`` payload (not ``[DONE]``)."""
        try:
            payload = json.loads(data)
        except ValueError:
            raise self._error(f"a data line is not JSON: {excerpt(data)!r}") from None
        if not isinstance(payload, dict):
            raise self._error(f"a data payload is not an object: {excerpt(data)!r}")
        self.payload_count += 1
        if payload.get("error") is not None:
            raise self._stream_error(payload["error"])
        if isinstance(payload.get("usage"), dict):
            self._usage = map_usage(payload["usage"])
        choices = payload.get("choices") or []
        if not isinstance(choices, list):
            raise self._error("'choices' is not a list")
        out: list[Chunk] = []
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice, out)
        return out

    def _choice(self, choice: Mapping[str, Any], out: list[Chunk]) -> None:
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise self._error("'delta' is not an object")
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._reasoning = self._stream_text(self._reasoning, "reasoning", reasoning, out)
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._text = self._stream_text(self._text, "text", content, out)
        for call in delta.get("tool_calls") or []:
            self._tool_call(call, out)
        reason = choice.get("finish_reason")
        if reason:  # null or "" on every chunk but the last
            if not isinstance(reason, str):
                raise self._error(f"finish_reason is not a string: {reason!r}")
            self._finish_reason = reason

    def _open(self, block_type: str, out: list[Chunk]) -> int:
        index = self._next_index
        self._next_index += 1
        self._blocks.append(index)
        out.append(block_start(index, block_type))
        return index

    def _stream_text(self, state: tuple[int, list[str]] | None, kind: str, text: str,
                     out: list[Chunk]) -> tuple[int, list[str]]:
        if state is None:
            state = (self._open(kind, out), [])
        state[1].append(text)
        out.append(text_delta(state[0], text) if kind == "text"
                   else reasoning_delta(state[0], text))
        return state

    def _tool_call(self, call: Any, out: list[Chunk]) -> None:
        if not isinstance(call, dict):
            raise self._error("a tool_calls entry is not an object")
        position = self._position(call)
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        block = self._tools.get(position)
        if block is None:
            call_id, name = call.get("id"), function.get("name")
            if not isinstance(call_id, str) or not call_id:
                raise self._error(f"tool call {position} starts without an id")
            if not isinstance(name, str) or not name:
                raise self._error(f"tool call {position} starts without a function name")
            block = self._tools[position] = _ToolBlock(self._open("tool-call", out), call_id,
                                                       name)
            block.arguments.append(arguments)
            out.append(tool_call_delta(block.index, call_id, arguments, name=name))
        elif arguments:
            block.arguments.append(arguments)
            out.append(tool_call_delta(block.index, block.call_id, arguments, name=block.name))

    def _position(self, call: Mapping[str, Any]) -> int:
        """The call's OpenAI index; servers that omit it mean "a new id is a new call"."""
        position = call.get("index")
        if isinstance(position, int) and not isinstance(position, bool):
            return position
        if position is not None:
            raise self._error(f"tool call index is not an integer: {position!r}")
        last = max(self._tools, default=None)
        call_id = call.get("id")
        if last is None or (call_id and call_id != self._tools[last].call_id):
            return 0 if last is None else last + 1
        return last

    def end(self) -> list[Chunk]:
        """The closing chunks once the body ended: block-ends, usage, finish."""
        if self._finish_reason is None:
            if self.payload_count == 0:
                raise ProviderError("the provider returned an empty stream (no answer at all)",
                                    code="EMPTY_RESPONSE", request_id=self._request_id)
            raise self._error("the stream ended without a finish_reason")
        failed = FAILED_FINISH_REASONS.get(self._finish_reason)
        if failed is not None:
            raise ProviderError(failed[1], code=failed[0], request_id=self._request_id)
        kind = FINISH_REASONS.get(self._finish_reason)
        if kind is None:
            raise self._error(f"unknown finish_reason {self._finish_reason!r}")
        if kind == "stop" and self._tools:
            kind = "tool-calls"  # some servers say "stop" after tool calls
        out = [block_end(index, self._block(index)) for index in self._blocks]
        if self._usage is not None:
            out.append(usage_chunk(self._usage))
        out.append(finish_chunk(kind))
        return out

    def _block(self, index: int) -> Block:
        for kind, state in (("reasoning", self._reasoning), ("text", self._text)):
            if state is not None and state[0] == index:
                return {"type": kind, "text": "".join(state[1])}
        for tool in self._tools.values():
            if tool.index == index:
                return {"type": "tool-call", "id": tool.call_id, "name": tool.name,
                        "arguments": "".join(tool.arguments)}
        raise AssertionError(f"no block {index}")  # unreachable: every index was opened here

    def _error(self, message: str) -> ProviderError:
        return protocol_error(message, request_id=self._request_id)

    def _stream_error(self, error: Any) -> ProviderError:
        """An ``{"error": ...}`` payload sent mid-stream (the HTTP status was already 200)."""
        message = error.get("message") if isinstance(error, dict) else error
        kind = (f"{error.get('type', '')} {error.get('code', '')}".lower()
                if isinstance(error, dict) else "")
        code = next((code for word, code in STREAM_ERROR_CODES if word in kind), "SERVER")
        return ProviderError(f"the provider failed mid-stream: {excerpt(str(message))}",
                             code=code, request_id=self._request_id)
