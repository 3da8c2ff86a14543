"""Hypothesis strategies for valid dsh session logs (format 0), replaces included.

Import from a test module (pytest puts ``tests/support/`` on ``sys.path``: the
``pythonpath`` option in pyproject.toml)::

    from strategies import valid_logs, lossless_json

    @given(valid_logs())
    def test_something(events: list[Event]) -> None: ...

``valid_logs()`` draws a list of :class:`~pipeline.core.events.Event` that a strict
:class:`~pipeline.core.log.SessionLog` accepts (a test checks this): turns and steps with
user messages, assistant chunks (text, reasoning, tool-call deltas, usage, finish), assistant
messages (sometimes with empty content, sometimes interrupted), tool calls and results (some
with errors), surface replaces (a ``user/message`` shadowing a random range of live nodes, a
``tool/result`` rewriting one result's content), plugin events and unknown ``ignorable``
events carrying arbitrary lossless JSON, unknown block and source kinds, ``null`` values
inside data, floats, unicode. With ``prefix=True`` (the default) it sometimes stops mid-turn,
so open turns, steps and pending tool calls occur too.

``lossless_json()`` draws arbitrary lossless JSON values (no NaN/inf, no -0.0, no surrogates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from pipeline.core.events import APPEND, Event, JsonValue, Replace

__all__ = ["lossless_json", "valid_logs"]

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False).map(lambda x: 0.0 if x == 0 else x)
    | st.text(max_size=12)
)


@functools.cache
def lossless_json(max_leaves: int = 8) -> st.SearchStrategy[JsonValue]:
    """Arbitrary lossless JSON: objects, arrays, strings, finite non-(-0) numbers, bools, null."""
    return st.recursive(
        _SCALARS,
        lambda children: st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6), children, max_size=3),
        max_leaves=max_leaves,
    )


_PLUGIN_TYPES = ("agent/inbox/spliced", "session/title", "llm/retry", "hook/invoked",
                 "compaction/start", "goal/change", "team/task")
_END_REASONS: tuple[JsonValue, ...] = (
    {"kind": "completed"}, {"kind": "aborted", "reason": {"kind": "user"}},
    {"kind": "blocked"}, {"kind": "max-tokens"},
    {"kind": "error", "error": {"message": "boom", "code": "SERVER", "status": 500}},
)


_ALPHABET = "abcXYZ 019_{}\"\\\n\u00e9\u4e2d\u0000\U0001f600"


@dataclass
class _Builder:
    """Appends events with contiguous seqs and tracks the live surface (seq, type).

    Small choices come from a seeded ``random.Random`` drawn once from Hypothesis (drawing
    each one through Hypothesis makes generation ten times slower); JSON payloads and the
    log's shape are drawn through Hypothesis so they shrink.
    """

    draw: Any
    rng: Any
    events: list[Event] = field(default_factory=list)
    surface: list[tuple[int, str]] = field(default_factory=list)
    time: int = 1_785_000_000_000
    ids: int = 0

    def add(self, type_: str, data: JsonValue, op: Any = None,
            sources: tuple[int, ...] | None = None, ignorable: bool | None = None) -> int:
        seq = len(self.events)
        self.time += self.int(-5, 500)
        self.events.append(Event(type_, seq, self.time, data, op, sources, ignorable))
        if op == APPEND:
            self.surface.append((seq, type_))
        elif isinstance(op, Replace):
            start = next(i for i, (s, _) in enumerate(self.surface) if s == op.start)
            end = next(i for i, (s, _) in enumerate(self.surface) if s == op.end)
            self.surface[start:end + 1] = [(seq, type_)]
        return seq

    def int(self, low: int, high: int) -> int:
        return int(self.rng.randint(low, high))

    def bool(self) -> bool:
        return bool(self.rng.random() < 0.5)

    def choice(self, options: Any) -> Any:
        return self.rng.choice(list(options))

    def text(self, max_size: int) -> str:
        return "".join(self.rng.choice(_ALPHABET) for _ in range(self.rng.randint(0, max_size)))

    def new_id(self, prefix: str) -> str:
        self.ids += 1
        return f"{prefix}-{self.ids}"


def _user_message(b: _Builder) -> dict[str, JsonValue]:
    kind = b.choice(["user", "plugin", "agent-instructions", "x-unknown-kind"])
    source: dict[str, JsonValue] = {"kind": kind}
    if kind != "user":
        source["extra"] = b.draw(lossless_json(4))
    blocks: list[JsonValue] = [{"type": "text", "text": b.text(30)}]
    if b.bool():
        blocks.append(b.choice([
            {"type": "image", "attachment": {"id": "att-1", "mime": "image/png"}},
            {"type": "x-future-block", "payload": None, "n": 1.5},
        ]))
    return {"content": blocks, "source": source, "role": "user", "id": b.new_id("u")}


def _chunks(b: _Builder, turn: int, step: int, calls: list[str]) -> list[int]:
    seqs: list[int] = []

    def chunk(body: dict[str, JsonValue]) -> None:
        seqs.append(b.add("assistant/chunk", {"turn": turn, "step": step, "chunk": body}))

    kinds = [b.choice(["text", "reasoning", "tool-call"]) for _ in range(b.int(0, 3))]
    for index, kind in enumerate(kinds):
        chunk({"type": "block-start", "index": index, "blockType": kind})
        pieces = [b.text(5) for _ in range(b.int(1, 6))]
        for piece in pieces:
            if kind == "tool-call":
                call_id = calls[-1] if calls else b.new_id("call")
                body: dict[str, JsonValue] = {"type": "tool-call-delta", "index": index,
                                              "id": call_id, "argumentsDelta": piece}
                if b.bool():
                    body = {**body, "name": "bash"}
                chunk(body)
            else:
                chunk({"type": f"{kind}-delta", "index": index, "text": piece})
    if b.bool():
        chunk({"type": "usage", "usage": {"inputTokens": 10, "outputTokens": 3}})
    if b.bool():
        chunk({"type": "finish", "reason": {"kind": "stop"}})
    return seqs


def _assistant(b: _Builder, turn: int, step: int) -> list[str]:
    """Chunks, then an assistant/message; returns the ids of the tool calls it makes."""
    calls = [b.new_id("call") for _ in range(b.int(0, 2))]
    chunk_seqs = _chunks(b, turn, step, calls)
    content: list[JsonValue] = []
    if b.bool():
        content.append({"type": "reasoning", "text": b.text(20)})
    if b.int(0, 4):
        content.append({"type": "text", "text": b.text(20)})
    content.extend({"type": "tool-call", "id": call, "name": "bash",
                    "arguments": b.choice(['{"a":1}', "{bad json", ""])}
                   for call in calls)
    message = {"role": "assistant", "content": content, "id": b.new_id("a"),
               "source": {"kind": "model", "provider": "scripted", "model": "m"}}
    data: dict[str, JsonValue] = {"turn": turn, "step": step, "message": message}
    if b.bool():
        data["usage"] = {"inputTokens": 5, "outputTokens": 2, "cacheReadTokens": 0}
    if b.int(0, 9) == 0:
        data["interrupted"] = True
    sources = b.choice([None, tuple(chunk_seqs)])
    b.add("assistant/message", data, APPEND, sources)
    return calls


def _tool_result_data(b: _Builder, turn: int, step: int, call: str) -> dict[str, JsonValue]:
    is_error = b.bool()
    block = {"type": "tool-result", "toolCallId": call,
             "content": [{"type": "text", "text": b.text(20)}],
             "isError": is_error}
    message = {"source": {"kind": "tool", "callId": call}, "content": [block],
               "role": "user", "id": b.new_id("r")}
    data: dict[str, JsonValue] = {"turn": turn, "step": step, "message": message}
    if is_error and b.bool():
        data["error"] = {"name": "ToolError", "code": "TOOL_FAILED"}
    if b.bool():
        data["meta"] = b.draw(lossless_json(4))
    return data


def _tools(b: _Builder, turn: int, step: int, calls: list[str]) -> None:
    for call in calls:
        call_seq = None
        if b.int(0, 5):
            call_seq = b.add("tool/call", {"turn": turn, "step": step, "callId": call,
                                           "name": "bash", "arguments": "{}"})
        sources = (call_seq,) if call_seq is not None else None
        b.add("tool/result", _tool_result_data(b, turn, step, call), APPEND, sources)


def _replace_range(b: _Builder) -> None:
    """A user/message (e.g. a compaction summary) shadowing a range of live nodes."""
    if not b.surface:
        return
    start = b.int(0, len(b.surface) - 1)
    end = b.int(start, len(b.surface) - 1)
    shadowed = [seq for seq, _ in b.surface[start:end + 1]]
    extra = [b.int(0, len(b.events) - 1) for _ in range(b.int(0, 2))]
    sources = tuple(dict.fromkeys([*shadowed, *extra]))
    op = Replace(b.surface[start][0], b.surface[end][0])
    b.add("user/message", _user_message(b), op, sources)


def _replace_tool_result(b: _Builder) -> None:
    """A tool/result rewriting only the content of one live tool/result (e.g. pruning)."""
    results = [seq for seq, kind in b.surface if kind == "tool/result"]
    if not results:
        return
    target = b.events[b.choice(results)]
    data = target.data
    block = {**data["message"]["content"][0],
             "content": [{"type": "text", "text": "[pruned]"}]}
    new_data = {**data, "message": {**data["message"], "content": [block]}}
    b.add("tool/result", new_data, Replace(target.seq, target.seq), (target.seq,))


def _side_events(b: _Builder) -> None:
    for _ in range(b.int(0, 2)):
        if b.bool():
            b.add(b.choice(_PLUGIN_TYPES), b.draw(lossless_json()))
        else:
            b.add("x-vendor/" + b.choice(["note", "trace"]),
                  b.draw(lossless_json()), ignorable=True)


def _step(b: _Builder, turn: int, step: int, first: bool) -> None:
    b.add("step/start", {"turn": turn, "step": step})
    for _ in range(b.int(1 if first else 0, 2)):
        b.add("user/message", _user_message(b), APPEND)
    if first:
        b.add("request/header", {"header": {"config": {"provider": "scripted", "model": "m"}},
                                  "reason": "initial"})
    calls = _assistant(b, turn, step)
    _tools(b, turn, step, calls)
    if b.int(0, 3) == 0:
        _replace_range(b)
    if b.int(0, 3) == 0:
        _replace_tool_result(b)
    _side_events(b)
    b.add("step/end", {"turn": turn, "step": step})


@st.composite
def valid_logs(draw: Any, *, max_turns: int = 3, max_steps: int = 3,
               prefix: bool = True) -> list[Event]:
    """A valid log (strict mode) with replaces; see the module docstring."""
    b = _Builder(draw, draw(st.randoms(use_true_random=False)))
    for turn in range(1, draw(st.integers(1, max_turns)) + 1):
        _side_events(b)
        b.add("turn/start", {"turn": turn})
        for step in range(1, draw(st.integers(0, max_steps)) + 1):
            _step(b, turn, step, step == 1)
        b.add("turn/end", {"turn": turn, "reason": draw(st.sampled_from(_END_REASONS))})
    if prefix and draw(st.booleans()):
        return b.events[:draw(st.integers(0, len(b.events)))]
    return b.events
