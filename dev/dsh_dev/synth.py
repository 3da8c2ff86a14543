"""Seeded synthetic dsh sessions: realistic, valid (strict) and deterministic from a seed.

Used by benchmarks, the demo and tests. Pure: a ``random.Random(seed)``, no clock, no I/O;
the same seed always gives the same events, byte for byte.

The mix follows the recorded fixtures (``fixtures/dsh-format0``), per turn:

- the inbox claim around ``turn/start`` (``agent/inbox/spliced`` inserted, then removed);
- 1-4 steps; the first claims the prompt (``user/message``, 80-400 chars) and, on turn 1, a
  runtime-context ``user/message`` (~400 chars), ``session/title``, ``request/header`` and
  ``request/context``, as dsh writes them;
- each step streams ``assistant/chunk`` events: ``block-start``, a reasoning run of 10-30
  ``reasoning-delta`` (one word each, 0-30 ms apart; the fixtures have runs of 17-25), then
  either a tool call (``tool-call-delta`` run of 15-35 argument pieces, 31 in the fixture) or
  a text answer (1-30 ``text-delta``), ``block-end`` per block, ``usage`` and ``finish``:
  chunks are ~87% of all events (fixtures: 70% for a one-step text turn, 84% for a tool turn);
- ``assistant/message`` (``sourceEventSeqs`` = that attempt's chunk seqs), then for a tool
  step ``tool/call`` and ``tool/result`` (60-600 chars), ``step/end``; ``turn/end completed``;
- rarer paths, each a few percent of turns: a provider error mid-stream (chunks ending in an
  error ``finish``, ``llm/retry``, ``llm/retry-started``, then the retried attempt), a cancel
  (``assistant/message {interrupted:true}``, ``turn/end aborted``), and every ~8 turns a
  compaction (``compaction/start``, a ``user/message`` summary *replacing* the oldest live
  surface nodes, ``compaction/end``).

:func:`synth_session` cuts the stream at exactly ``n`` events (so the last turn may be open, as
after a crash); :func:`iter_synth_events` is the endless stream.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Final

from pipeline.core.events import APPEND, Event, JsonValue, Replace

_WORDS: Final = (
    "the", "user", "wants", "me", "to", "run", "a", "command", "and", "then", "reply", "file",
    "read", "check", "output", "test", "build", "fix", "error", "in", "module", "config",
    "Kafka", "topic", "partition", "session", "event", "log", "value", "should", "now", "I",
    "will", "look", "at", "this", "first", "because", "it", "is", "done", ".", ",", "\n",
    "café", "数据", "→",
)
_TOOLS: Final = ("bash", "read", "write", "grep")
BASE_TIME: Final = 1_785_000_000_000


class _Writer:
    """Appends events with contiguous seqs and moving time, tracking the live surface."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.seq = 0
        self.time = BASE_TIME + self.rng.randrange(10**9)
        self.turn = 0
        self.surface: list[int] = []
        self.out: list[Event] = []
        self.ids = 0

    def add(self, type_: str, data: JsonValue, op: Any = None,
            sources: tuple[int, ...] | None = None, *, dt: int = 1) -> int:
        self.time += dt
        seq = self.seq
        self.out.append(Event(type_, seq, self.time, data, op, sources))
        self.seq += 1
        if op == APPEND:
            self.surface.append(seq)
        elif isinstance(op, Replace):
            start, end = self.surface.index(op.start), self.surface.index(op.end)
            self.surface[start:end + 1] = [seq]
        return seq

    def words(self, low: int, high: int) -> str:
        count = self.rng.randint(low, high)
        return " ".join(self.rng.choice(_WORDS) for _ in range(count))

    def pieces(self, text: str, count: int) -> list[str]:
        """Split ``text`` into ``count`` stream pieces (some may be empty, like real ones)."""
        cuts = sorted(self.rng.randint(0, len(text)) for _ in range(count - 1))
        bounds = [0, *cuts, len(text)]
        return [text[bounds[i]:bounds[i + 1]] for i in range(count)]

    def new_id(self, prefix: str) -> str:
        self.ids += 1
        return f"{prefix}-{self.seed}-{self.ids}"


def _user(w: _Writer, text: str, kind: str = "user") -> dict[str, JsonValue]:
    return {"content": [{"type": "text", "text": text}], "source": {"kind": kind},
            "role": "user", "id": w.new_id("msg")}


def _chunk(w: _Writer, step: int, body: dict[str, JsonValue], seqs: list[int],
           dt: int = 1) -> None:
    seqs.append(w.add("assistant/chunk", {"turn": w.turn, "step": step, "chunk": body}, dt=dt))


def _stream_block(w: _Writer, step: int, index: int, kind: str, seqs: list[int]) -> JsonValue:
    """block-start, a run of deltas, and the block it assembles to (block-end comes later)."""
    _chunk(w, step, {"type": "block-start", "index": index, "blockType": kind}, seqs, dt=900)
    if kind == "tool-call":
        call_id, name = w.new_id("call"), w.rng.choice(_TOOLS)
        arguments = '{"command": "' + w.words(3, 12).replace('"', "'") + '"}'
        for piece in w.pieces(arguments, w.rng.randint(15, 35)):
            _chunk(w, step, {"type": "tool-call-delta", "index": index, "id": call_id,
                             "name": name, "argumentsDelta": piece}, seqs, w.rng.randint(0, 30))
        return {"type": "tool-call", "id": call_id, "name": name, "arguments": arguments}
    low, high = (10, 30) if kind == "reasoning" else (1, 30)
    count = w.rng.randint(low, high)
    text = w.words(count, count)
    for piece in w.pieces(text, count):
        _chunk(w, step, {"type": f"{kind}-delta", "index": index, "text": piece}, seqs,
               w.rng.randint(0, 30))
    return {"type": kind, "text": text}


def _attempt(w: _Writer, step: int, *, tool: bool) -> tuple[list[JsonValue], list[int], Any]:
    seqs: list[int] = []
    blocks = [_stream_block(w, step, 0, "reasoning", seqs),
              _stream_block(w, step, 1, "tool-call" if tool else "text", seqs)]
    for index, block in enumerate(blocks):
        _chunk(w, step, {"type": "block-end", "index": index, "block": block}, seqs)
    output = w.rng.randint(20, 400)
    usage = {"inputTokens": w.rng.randint(100, 4000), "outputTokens": output,
             "cacheReadTokens": w.rng.choice([0, 2816, 5632]),
             "reasoningTokens": w.rng.randint(0, output)}
    _chunk(w, step, {"type": "usage", "usage": usage}, seqs, dt=200)
    _chunk(w, step, {"type": "finish", "reason": {"kind": "tool-calls" if tool else "stop"}},
           seqs)
    return blocks, seqs, usage


def _failed_attempt(w: _Writer, step: int) -> None:
    seqs: list[int] = []
    _stream_block(w, step, 0, "reasoning", seqs)
    failure = {"message": "upstream overloaded", "code": "SERVER", "status": 503}
    _chunk(w, step, {"type": "finish", "reason": {"kind": "error", "failure": failure}}, seqs)
    w.add("llm/retry", {"turn": w.turn, "step": step, "attempt": 1, "delayMs": 500,
                        "error": failure})
    w.add("llm/retry-started", {"turn": w.turn, "step": step, "attempt": 2}, dt=500)


def _model_source() -> dict[str, JsonValue]:
    return {"kind": "model", "provider": "deepseek-official", "model": "deepseek-v4-flash"}


def _step(w: _Writer, step: int, *, tool: bool, cancel: bool) -> None:
    if w.rng.random() < 0.04:
        _failed_attempt(w, step)
    if cancel:
        seqs: list[int] = []
        block = _stream_block(w, step, 0, "text", seqs)
        message = {"role": "assistant", "content": [block], "source": _model_source(),
                   "id": w.new_id("msg")}
        w.add("assistant/message", {"turn": w.turn, "step": step, "message": message,
                                    "interrupted": True}, APPEND, tuple(seqs), dt=300)
        return
    blocks, seqs, usage = _attempt(w, step, tool=tool)
    message = {"role": "assistant", "content": blocks, "source": _model_source(),
               "id": w.new_id("msg")}
    w.add("assistant/message", {"turn": w.turn, "step": step, "message": message,
                                "usage": usage}, APPEND, tuple(seqs))
    if tool:
        _tool(w, step, blocks[1])


def _tool(w: _Writer, step: int, call: Any) -> None:
    call_seq = w.add("tool/call", {"turn": w.turn, "step": step, "callId": call["id"],
                                   "name": call["name"], "arguments": call["arguments"]})
    output = w.words(10, 100)
    result = {"type": "tool-result", "toolCallId": call["id"],
              "content": [{"type": "text", "text": output}], "isError": False}
    message = {"source": {"kind": "tool", "callId": call["id"]}, "content": [result],
               "role": "user", "id": w.new_id("msg")}
    w.add("tool/result", {"turn": w.turn, "step": step, "message": message}, APPEND,
          (call_seq,), dt=w.rng.randint(10, 2000))


def _turn_opening(w: _Writer, step: int) -> None:
    prompt = _user(w, w.words(15, 80))
    w.add("user/message", prompt, APPEND)
    if w.turn == 1:
        w.add("user/message", _user(w, "Current runtime context. " + w.words(60, 80),
                                    "plugin"), APPEND)
        w.add("session/title", {"title": prompt["content"][0]["text"][:40],
                                "messageSeqs": [w.seq - 2], "source": {"kind": "fallback"}})
        w.add("request/header", {"header": {"config": {"provider": "deepseek-official",
                                                       "model": "deepseek-v4-flash"},
                                            "system": "You are a coding agent."},
                                 "reason": "initial"})
    w.add("request/context", {"provider": "deepseek-official", "model": "deepseek-v4-flash"})


def _compaction(w: _Writer) -> None:
    if len(w.surface) < 4:
        return
    end = w.rng.randint(1, len(w.surface) - 2)
    shadowed = tuple(w.surface[:end + 1])
    compaction_id = w.new_id("compaction")
    w.add("compaction/start", {"compactionId": compaction_id, "nodes": len(shadowed)})
    summary = _user(w, "Earlier context was compacted: " + w.words(40, 120), "plugin")
    w.add("user/message", summary, Replace(shadowed[0], shadowed[-1]), shadowed, dt=3000)
    w.add("compaction/end", {"compactionId": compaction_id})


def _turn(w: _Writer) -> list[Event]:
    w.out = []
    w.turn += 1
    if w.turn % 8 == 0:
        _compaction(w)
    inserted = _user(w, "(queued)")
    w.add("agent/inbox/spliced", {"target": "next-turn", "start": 0, "inserted": [inserted]},
          dt=w.rng.randint(1000, 60000))
    w.add("turn/start", {"turn": w.turn})
    w.add("agent/inbox/spliced", {"target": "next-turn", "start": 0, "removedCount": 1,
                                  "inserted": []})
    steps = w.rng.randint(1, 4)
    cancel = w.rng.random() < 0.04
    for step in range(1, steps + 1):
        w.add("step/start", {"turn": w.turn, "step": step})
        if step == 1:
            _turn_opening(w, step)
        last = step == steps
        _step(w, step, tool=not last, cancel=cancel and last)
        w.add("step/end", {"turn": w.turn, "step": step})
    reason = {"kind": "aborted", "reason": {"kind": "user"}} if cancel else {"kind": "completed"}
    w.add("turn/end", {"turn": w.turn, "reason": reason})
    return w.out


def iter_synth_events(seed: int) -> Iterator[Event]:
    """The endless synthetic session of ``seed`` (seqs 0, 1, 2, ...)."""
    writer = _Writer(seed)
    while True:
        yield from _turn(writer)


def synth_session(seed: int, n_events: int) -> list[Event]:
    """The first ``n_events`` events of the synthetic session of ``seed``."""
    events: list[Event] = []
    if n_events <= 0:
        return events
    for event in iter_synth_events(seed):
        events.append(event)
        if len(events) == n_events:
            return events
    return events  # pragma: no cover (the stream is endless)


def synth_header(seed: int) -> dict[str, JsonValue]:
    """A session-file header for the synthetic session of ``seed``."""
    return {"type": "session", "version": 0, "id": f"synth-{seed}", "createdAt": BASE_TIME,
            "cwd": "/work", "delegationDepth": 0}
