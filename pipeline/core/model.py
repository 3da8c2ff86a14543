"""What a model provider is asked and what it streams back, in dsh's own shapes.

A provider receives a :class:`ModelRequest` (the derived messages of the log plus the request
header) and streams **dsh chunk dicts**, exactly as they appear in ``assistant/chunk``
``data.chunk``::

    block-start {index, blockType}        text-delta {index, text}
    reasoning-delta {index, text}         tool-call-delta {index, id, name?, argumentsDelta}
    block-end {index, block}              usage {usage}
    finish {reason}   reason.kind: stop | tool-calls | max-tokens | aborted{failure}
                      | error{failure}

Provider contract (used by the turn machine): a successful stream yields blocks, then
``block-end`` for every block in index order, an optional ``usage``, and exactly one
``finish`` whose kind is ``stop``, ``tool-calls`` or ``max-tokens``. A failure is raised as
:class:`~pipeline.core.errors.ProviderError` (possibly after some chunks); the caller then
records :func:`error_finish` itself. ``aborted`` is likewise written by the caller on cancel.

Everything here is pure: no clock, no randomness (jitter is passed in), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from pipeline.core.errors import ProviderError, TurnError

JsonValue: TypeAlias = Any
Chunk: TypeAlias = dict[str, JsonValue]
"""One dsh stream chunk (the ``data.chunk`` of an ``assistant/chunk`` event)."""
Block: TypeAlias = dict[str, JsonValue]
"""One content block (``text``, ``reasoning``, ``tool-call``, ...)."""

FINISH_KINDS: Final = frozenset({"stop", "tool-calls", "max-tokens", "aborted", "error"})
SUCCESS_FINISH_KINDS: Final = frozenset({"stop", "tool-calls", "max-tokens"})
STREAMED_BLOCK_TYPES: Final = frozenset({"text", "reasoning", "tool-call"})


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One model call, built only from the log: derived messages plus the request header.

    ``messages`` are the dsh messages exactly as the derivation returns them (never copied or
    rewritten here); ``tools`` are JSON tool definitions (``{name, description?, parameters}``
    or OpenAI's ``{type:"function", function:{...}}``). Equality is structural, so the turn
    machine can compare the request it sends with the one the log derives.
    """

    provider: str
    model: str
    messages: tuple[JsonValue, ...]
    system: str | None = None
    tools: tuple[JsonValue, ...] | None = None
    reasoning_effort: str | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.provider, str) or not self.provider:
            raise TurnError("ModelRequest.provider must be a non-empty string")
        if not isinstance(self.model, str) or not self.model:
            raise TurnError("ModelRequest.model must be a non-empty string")
        if not isinstance(self.messages, tuple):
            raise TurnError("ModelRequest.messages must be a tuple of dsh messages")
        if self.tools is not None and not isinstance(self.tools, tuple):
            raise TurnError("ModelRequest.tools must be a tuple of tool definitions or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens <= 0
        ):
            raise TurnError(f"ModelRequest.max_tokens must be a positive int, got "
                            f"{self.max_tokens!r}")


# --------------------------------------------------------------------------- chunk builders


def block_start(index: int, block_type: str) -> Chunk:
    return {"type": "block-start", "index": index, "blockType": block_type}


def text_delta(index: int, text: str) -> Chunk:
    return {"type": "text-delta", "index": index, "text": text}


def reasoning_delta(index: int, text: str) -> Chunk:
    return {"type": "reasoning-delta", "index": index, "text": text}


def tool_call_delta(index: int, call_id: str, arguments_delta: str,
                    name: str | None = None) -> Chunk:
    """dsh repeats the call's ``name`` on every delta (so packed rows can carry it once)."""
    chunk: Chunk = {"type": "tool-call-delta", "index": index, "id": call_id}
    if name is not None:
        chunk["name"] = name
    chunk["argumentsDelta"] = arguments_delta
    return chunk


def block_end(index: int, block: Block) -> Chunk:
    return {"type": "block-end", "index": index, "block": block}


def usage_chunk(usage: Mapping[str, int]) -> Chunk:
    return {"type": "usage", "usage": dict(usage)}


def make_usage(*, input_tokens: int, output_tokens: int, cache_read_tokens: int | None = None,
               cache_write_tokens: int | None = None,
               reasoning_tokens: int | None = None) -> dict[str, int]:
    """A dsh usage object (disjoint counts; absent optional counts are left out)."""
    usage = {"inputTokens": input_tokens, "outputTokens": output_tokens}
    if cache_read_tokens is not None:
        usage["cacheReadTokens"] = cache_read_tokens
    if cache_write_tokens is not None:
        usage["cacheWriteTokens"] = cache_write_tokens
    if reasoning_tokens is not None:
        usage["reasoningTokens"] = reasoning_tokens
    return usage


def finish_chunk(kind: str) -> Chunk:
    """A successful finish: ``stop``, ``tool-calls`` or ``max-tokens``."""
    if kind not in SUCCESS_FINISH_KINDS:
        raise TurnError(f"finish_chunk takes stop/tool-calls/max-tokens, got {kind!r}; use "
                        "error_finish or aborted_finish for failures")
    return {"type": "finish", "reason": {"kind": kind}}


def failure_of(error: ProviderError) -> dict[str, JsonValue]:
    """The failure object of an error finish (same keys as ``turn/end`` error)."""
    failure: dict[str, JsonValue] = {"message": str(error), "code": error.code}
    if error.status is not None:
        failure["status"] = error.status
    if error.retry_after_ms is not None:
        failure["providerRetryAfterMs"] = error.retry_after_ms
    if error.request_id is not None:
        failure["requestId"] = error.request_id
    return failure


def error_finish(error: ProviderError) -> Chunk:
    """The chunk the caller records after a provider call failed mid-stream or up front."""
    return {"type": "finish", "reason": {"kind": "error", "failure": failure_of(error)}}


def aborted_finish(message: str = "cancelled", code: str = "ABORTED") -> Chunk:
    """The chunk the caller records when it cancels a stream."""
    return {"type": "finish",
            "reason": {"kind": "aborted", "failure": {"message": message, "code": code}}}


# --------------------------------------------------------------------------- assembly


@dataclass(slots=True)
class _OpenBlock:
    block_type: str
    parts: list[str] = field(default_factory=list)
    call_id: str | None = None
    name: str | None = None

    def partial(self) -> Block | None:
        """What the user already saw of this unfinished block (None: nothing usable)."""
        text = "".join(self.parts)
        if self.block_type in ("text", "reasoning") and text:
            return {"type": self.block_type, "text": text}
        return None  # unfinished tool calls are never stored: they cannot be answered


class StreamAccumulator:
    """Folds a chunk stream into the assistant message's content, usage and finish.

    ``content()`` is the final content (the ``block-end`` blocks in index order), which is
    what ``assistant/message`` stores; ``partial_content()`` adds the text already streamed
    for blocks that never ended (cancel mid-stream). Cost: O(1) per chunk.
    """

    __slots__ = ("_closed", "_open", "chunk_count", "finish", "usage")

    def __init__(self) -> None:
        self._open: dict[int, _OpenBlock] = {}
        self._closed: dict[int, Block] = {}
        self.usage: dict[str, JsonValue] | None = None
        self.finish: dict[str, JsonValue] | None = None
        self.chunk_count = 0

    def add(self, chunk: Mapping[str, JsonValue]) -> None:
        self.chunk_count += 1
        kind = chunk.get("type")
        if kind in ("text-delta", "reasoning-delta"):
            self._block(chunk, "text" if kind == "text-delta" else "reasoning").parts.append(
                chunk.get("text", ""))
        elif kind == "tool-call-delta":
            block = self._block(chunk, "tool-call")
            block.call_id = chunk.get("id", block.call_id)
            block.name = chunk.get("name", block.name)
            block.parts.append(chunk.get("argumentsDelta", ""))
        elif kind == "block-start":
            self._open[chunk["index"]] = _OpenBlock(str(chunk.get("blockType")))
        elif kind == "block-end":
            self._open.pop(chunk["index"], None)
            self._closed[chunk["index"]] = chunk["block"]
        elif kind == "usage":
            self.usage = chunk.get("usage")
        elif kind == "finish":
            self.finish = chunk.get("reason")
        # other chunk types are carried in the log and do not shape the content

    def _block(self, chunk: Mapping[str, JsonValue], block_type: str) -> _OpenBlock:
        index = chunk.get("index", -1)
        block = self._open.get(index)
        if block is None:  # a delta without block-start (simplified logs) opens its block
            block = self._open[index] = _OpenBlock(block_type)
        return block

    @property
    def finish_kind(self) -> str | None:
        return None if self.finish is None else self.finish.get("kind")

    def content(self) -> list[Block]:
        """The ended blocks in index order: the final ``assistant/message`` content."""
        return [self._closed[i] for i in sorted(self._closed)]

    def partial_content(self) -> list[Block]:
        """Ended blocks plus the visible text of unfinished ones (for an interrupted message)."""
        blocks: dict[int, Block] = dict(self._closed)
        for index, open_block in self._open.items():
            partial = open_block.partial()
            if partial is not None:
                blocks[index] = partial
        return [blocks[i] for i in sorted(blocks)]


def assemble(chunks: Iterable[Mapping[str, JsonValue]]) -> list[Block]:
    """The assistant message content built from a finished stream's ``block-end`` blocks."""
    acc = StreamAccumulator()
    for chunk in chunks:
        acc.add(chunk)
    return acc.content()


def tool_calls_of(content: Iterable[Block]) -> list[Block]:
    """The ``tool-call`` blocks of an assistant content list, in model order."""
    return [block for block in content if block.get("type") == "tool-call"]


# --------------------------------------------------------------------------- retries


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with equal jitter that honours the provider's Retry-After.

    ``attempt`` is the 1-based number of the attempt that just failed. ``jitter`` is a value
    in [0, 1] the caller draws (so this stays deterministic and testable). A Retry-After
    longer than ``max_retry_after_ms`` is not waited for: the call gives up instead.
    """

    max_attempts: int = 4
    base_ms: int = 500
    max_ms: int = 30_000
    max_retry_after_ms: int = 120_000
    retriable_codes: frozenset[str] | None = None  # None: ProviderError.retriable decides

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_ms < 0 or self.max_ms < self.base_ms:
            raise TurnError(f"RetryPolicy needs max_attempts >= 1 and 0 <= base_ms <= max_ms, "
                            f"got {self.max_attempts}, {self.base_ms}, {self.max_ms}")

    def is_retriable(self, error: ProviderError) -> bool:
        if self.retriable_codes is None:
            return error.retriable
        return error.code in self.retriable_codes

    def should_retry(self, attempt: int, error: ProviderError) -> bool:
        """Whether to make attempt ``attempt + 1`` after ``error``."""
        if attempt < 1:
            raise TurnError(f"attempt numbers start at 1, got {attempt}")
        if attempt >= self.max_attempts or not self.is_retriable(error):
            return False
        return error.retry_after_ms is None or error.retry_after_ms <= self.max_retry_after_ms

    def delay_ms(self, attempt: int, error: ProviderError, jitter: float = 0.5) -> int:
        """Milliseconds to wait before the next attempt: backoff, at least Retry-After."""
        if attempt < 1:
            raise TurnError(f"attempt numbers start at 1, got {attempt}")
        if not 0.0 <= jitter <= 1.0:
            raise TurnError(f"jitter must be in [0, 1], got {jitter}")
        ceiling = min(self.max_ms, self.base_ms << min(attempt - 1, 32))
        backoff = ceiling // 2 + round(jitter * (ceiling - ceiling // 2))
        if error.retry_after_ms is not None:
            return max(backoff, error.retry_after_ms)
        return backoff
