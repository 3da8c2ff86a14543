"""A deterministic, cheap model provider for demos, tests and benchmarks.

A *script* is a function ``(request, attempt) -> ScriptedReply``; ``attempt`` counts the
calls made with the same request (same message count and last message id), so a script can
fail the first attempt and succeed on the retry. A reply streams exactly the chunk order a
real provider produces (reasoning block, text block, tool-call blocks, block-ends in index
order, usage, finish), can fail with any :class:`ProviderError` code before or in the middle
of its stream, and can wait before its first chunk and between chunks. Without delays a
reply costs a handful of small dicts and never touches the event loop's timers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from pipeline.core.errors import ProviderError
from pipeline.core.model import (
    Chunk,
    ModelRequest,
    block_end,
    block_start,
    finish_chunk,
    make_usage,
    reasoning_delta,
    text_delta,
    tool_call_delta,
    usage_chunk,
)

MAX_TRACKED_FAILURES: Final = 100_000


@dataclass(frozen=True, slots=True)
class ScriptedToolCall:
    name: str
    arguments: str = "{}"
    id: str | None = None  # None: ``call_<step>_<n>``, unique within a conversation


@dataclass(frozen=True, slots=True)
class ScriptedError:
    """A failure raised after ``after_chunks`` chunks of the reply's content."""

    code: str
    message: str = "scripted provider failure"
    status: int | None = None
    retry_after_ms: int | None = None
    after_chunks: int = 0

    def to_error(self) -> ProviderError:
        return ProviderError(self.message, code=self.code, status=self.status,
                             retry_after_ms=self.retry_after_ms, request_id="scripted")


@dataclass(frozen=True, slots=True)
class ScriptedReply:
    """One scripted answer. ``finish`` defaults to tool-calls/stop from the content."""

    text: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    finish: str | None = None
    usage: Mapping[str, int] | None = field(default=None, hash=False)
    error: ScriptedError | None = None
    delay_ms: int = 0
    chunk_delay_ms: int = 0
    pieces: int = 2  # deltas per text/reasoning/arguments string


Script: TypeAlias = Callable[[ModelRequest, int], ScriptedReply]


def _split(text: str, pieces: int) -> list[str]:
    if pieces <= 1 or len(text) <= 1:
        return [text]
    size = -(-len(text) // pieces)
    return [text[i:i + size] for i in range(0, len(text), size)]


def _assistant_count(request: ModelRequest) -> int:
    return sum(1 for m in request.messages if isinstance(m, Mapping)
               and m.get("role") == "assistant")


def content_chunks(reply: ScriptedReply, step: int) -> tuple[list[Chunk], list[Chunk]]:
    """(streamed content chunks, closing chunks) of a reply; ``step`` names tool-call ids."""
    streamed: list[Chunk] = []
    blocks: list[dict[str, Any]] = []
    for kind, text in (("reasoning", reply.reasoning), ("text", reply.text)):
        if text:
            index = len(blocks)
            streamed.append(block_start(index, kind))
            make = reasoning_delta if kind == "reasoning" else text_delta
            streamed.extend(make(index, piece) for piece in _split(text, reply.pieces))
            blocks.append({"type": kind, "text": text})
    for n, call in enumerate(reply.tool_calls):
        index, call_id = len(blocks), call.id or f"call_{step}_{n}"
        streamed.append(block_start(index, "tool-call"))
        streamed.extend(tool_call_delta(index, call_id, piece, name=call.name)
                        for piece in _split(call.arguments, reply.pieces))
        blocks.append({"type": "tool-call", "id": call_id, "name": call.name,
                       "arguments": call.arguments})
    closing = [block_end(i, block) for i, block in enumerate(blocks)]
    closing.append(usage_chunk(reply.usage if reply.usage is not None
                               else _default_usage(reply, step)))
    finish = reply.finish or ("tool-calls" if reply.tool_calls else "stop")
    closing.append(finish_chunk(finish))
    return streamed, closing


def _default_usage(reply: ScriptedReply, step: int) -> dict[str, int]:
    reasoning = len(reply.reasoning or "") // 4
    output = reasoning + len(reply.text or "") // 4 + sum(
        len(c.arguments) // 4 + 1 for c in reply.tool_calls) + 1
    return make_usage(input_tokens=100 * step, output_tokens=output, cache_read_tokens=0,
                      reasoning_tokens=reasoning if reply.reasoning else None)


class ScriptedProvider:
    """A :class:`ModelProvider` whose answers come from a script function."""

    def __init__(self, script: Script, *, name: str = "scripted") -> None:
        self.name = name
        self._script = script
        self._attempts: dict[tuple[int, Any], int] = {}  # only failing requests stay here
        self.calls = 0

    @classmethod
    def replying(cls, replies: Iterable[ScriptedReply], *,
                 name: str = "scripted") -> ScriptedProvider:
        """Replies handed out in order, whatever the request (for one-session tests)."""
        queue = list(replies)
        used = 0

        def next_reply(request: ModelRequest, attempt: int) -> ScriptedReply:
            nonlocal used
            if used >= len(queue):
                raise ProviderError(f"the scripted provider has no reply left after {used}",
                                    code="BAD_REQUEST")
            used += 1
            return queue[used - 1]

        return cls(next_reply, name=name)

    def _attempt(self, request: ModelRequest) -> tuple[tuple[int, Any], int]:
        last = request.messages[-1] if request.messages else None
        key = (len(request.messages), last.get("id") if isinstance(last, Mapping) else None)
        attempt = self._attempts.get(key, 0) + 1
        if len(self._attempts) >= MAX_TRACKED_FAILURES:  # failures never retried: forget
            self._attempts.clear()
        self._attempts[key] = attempt
        return key, attempt

    async def stream(self, request: ModelRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        key, attempt = self._attempt(request)
        reply = self._script(request, attempt)
        if reply.error is None:
            del self._attempts[key]
        streamed, closing = content_chunks(reply, _assistant_count(request) + 1)
        if reply.delay_ms:
            await asyncio.sleep(reply.delay_ms / 1000)
        if reply.error is not None:
            streamed = streamed[:reply.error.after_chunks]
            closing = []
        for position, chunk in enumerate([*streamed, *closing]):
            if position and reply.chunk_delay_ms:
                await asyncio.sleep(reply.chunk_delay_ms / 1000)
            yield chunk
        if reply.error is not None:
            raise reply.error.to_error()

    async def aclose(self) -> None:
        self._attempts.clear()


# --------------------------------------------------------------------------- ready scripts


def _last_user_text(request: ModelRequest) -> tuple[str, bool]:
    """(text of the last message, whether it carries tool results)."""
    if not request.messages or not isinstance(request.messages[-1], Mapping):
        return "", False
    content = request.messages[-1].get("content")
    if isinstance(content, str):
        return content, False
    texts: list[str] = []
    has_results = False
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, Mapping):
            continue
        if block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        elif block.get("type") == "tool-result":
            has_results = True
            texts.extend(str(b.get("text", "")) for b in block.get("content", [])
                         if isinstance(b, Mapping) and b.get("type") == "text")
    return "\n".join(texts), has_results


def echo_script(request: ModelRequest, attempt: int) -> ScriptedReply:
    """Reasoning, then the last message's text echoed back: a one-step turn."""
    text, _ = _last_user_text(request)
    return ScriptedReply(reasoning=f"The user wrote {len(text)} characters.",
                         text=f"Echo: {text[:200]}")


def tool_loop_script(tool_name: str, arguments: str = "{}") -> Script:
    """A two-step turn: call ``tool_name`` after a user message, then answer its result."""

    def script(request: ModelRequest, attempt: int) -> ScriptedReply:
        text, has_results = _last_user_text(request)
        if has_results:
            return ScriptedReply(reasoning="The tool answered.", text=f"Done: {text[:200]}")
        return ScriptedReply(reasoning=f"I will call {tool_name}.",
                             tool_calls=(ScriptedToolCall(tool_name, arguments),))

    return script


def named_tool_script(tool_name: str, arguments: str = "{}") -> Script:
    """``driver --script-tool``: call ``tool_name`` once with ``arguments`` after a user
    message, then answer with the tool's whole result text (a demo or test drives a real
    tool, an MCP server's too, without a model). An error result is answered the same way,
    prefixed ``Tool error:``."""

    def script(request: ModelRequest, attempt: int) -> ScriptedReply:
        text, has_results = _last_user_text(request)
        if has_results:
            failed = _last_result_failed(request)
            return ScriptedReply(reasoning=f"{tool_name} answered.",
                                 text=f"{'Tool error' if failed else 'Result'}: {text}")
        return ScriptedReply(reasoning=f"I will call {tool_name}.",
                             tool_calls=(ScriptedToolCall(tool_name, arguments),))

    return script


def _last_result_failed(request: ModelRequest) -> bool:
    last = request.messages[-1] if request.messages else None
    content = last.get("content") if isinstance(last, Mapping) else None
    return any(isinstance(b, Mapping) and b.get("type") == "tool-result" and b.get("isError")
               for b in (content if isinstance(content, list) else []))
