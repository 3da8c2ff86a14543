"""A synchronous harness that drives a TurnMachine with scripted results (no event loop).

A *step script* answers each ``CallModel``: a list of chunks to stream, then either the end
of the stream or a :class:`ProviderError`. Tool outcomes come from a dict by call id (or a
default echo). Pre-step hooks are a plain function over the claimed messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import ProviderError
from pipeline.core.events import Event
from pipeline.core.log import SessionLog
from pipeline.core.model import ModelRequest
from pipeline.core.provider_routes import Route
from pipeline.core.turn_effects import (
    CallModel,
    ChooseRoute,
    HookDecision,
    Idle,
    RunPreStepHooks,
    RunTools,
    SessionConfig,
    Sleep,
    StepBoundary,
    ToolOutcome,
)
from pipeline.core.turn_machine import TurnMachine

FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")
CONFIG = SessionConfig("deepseek-official", "deepseek-v4-flash", system="{{system}}")


def counter_ids(prefix: str = "id") -> Callable[[], str]:
    numbers = itertools.count(1)
    return lambda: f"{prefix}-{next(numbers)}"


def fixture_events(name: str) -> tuple[Event, ...]:
    return read_session_file(FIXTURES / f"{name}.jsonl").events


@dataclass
class Attempt:
    """One scripted provider call: chunks, then success (error None) or the error."""

    chunks: Sequence[Mapping[str, Any]]
    error: ProviderError | None = None
    cancel_after: int | None = None  # submit a cancel after this many chunks


@dataclass
class Harness:
    machine: TurnMachine
    attempts: Iterator[Attempt]
    tool_outcomes: Mapping[str, ToolOutcome] = field(default_factory=dict)
    hook: Callable[[RunPreStepHooks], HookDecision] | None = None
    requests: list[ModelRequest] = field(default_factory=list)
    sleeps: list[int] = field(default_factory=list)
    boundaries: int = 0
    time: int = 1_000
    on_tools: Callable[[Harness, RunTools], bool] | None = None
    # a machine made with routing=True: the route of each step, and where a failure moves to
    route: Callable[[ChooseRoute], tuple[Route, str]] | None = None
    fallback: Callable[[ProviderError], Route | None] | None = None

    def now(self) -> int:
        self.time += 1
        return self.time

    def run(self, limit: int = 10_000) -> list[Event]:
        """Perform effects until Idle; returns the events appended meanwhile."""
        for _ in range(limit):
            effect = self.machine.next_effect(self.now())
            if isinstance(effect, Idle):
                return self.machine.take_events()
            self._perform(effect)
        raise AssertionError("the machine did not become idle")

    def _perform(self, effect: object) -> None:
        m = self.machine
        if isinstance(effect, StepBoundary):
            self.boundaries += 1
        elif isinstance(effect, RunPreStepHooks):
            decision = self.hook(effect) if self.hook else HookDecision(effect.messages)
            m.hooks_done(decision, self.now())
        elif isinstance(effect, CallModel):
            m.check_request(effect.request)
            self.requests.append(effect.request)
            self._stream(next(self.attempts))
        elif isinstance(effect, ChooseRoute):
            assert self.route is not None, "a routing machine needs Harness.route"
            chosen, reason = self.route(effect)
            m.route_chosen(chosen.provider, chosen.model, reason, self.now())
        elif isinstance(effect, Sleep):
            self.sleeps.append(effect.ms)
            m.sleep_done(self.now())
        elif isinstance(effect, RunTools) and (self.on_tools is None
                                               or self.on_tools(self, effect)):
            for call in effect.calls:
                m.tool_started(call.call_id, self.now())
                m.tool_finished(call.call_id, self.outcome(call.call_id), self.now())

    def outcome(self, call_id: str) -> ToolOutcome:
        return self.tool_outcomes.get(call_id, ToolOutcome.text(f"ran {call_id}"))

    def _stream(self, attempt: Attempt) -> None:
        m = self.machine
        for index, chunk in enumerate(attempt.chunks):
            if attempt.cancel_after == index:
                from pipeline.core.inbox import Cancel
                m.submit(Cancel("s1", "cancel-1", keep_queue=True), self.now())
                return
            m.chunk(chunk, self.now())
        if attempt.error is not None:
            fallback = self.fallback(attempt.error) if self.fallback is not None else None
            m.stream_failed(attempt.error, self.now(), jitter=0.0, fallback=fallback)
        else:
            m.stream_ended(self.now())


def new_machine(log: SessionLog | None = None, *, config: SessionConfig | None = CONFIG,
                **kwargs: Any) -> TurnMachine:
    return TurnMachine(log or SessionLog("s1"), new_id=counter_ids(), config=config, **kwargs)


def text_reply(text: str, *, finish: str = "stop") -> list[dict[str, Any]]:
    return [
        {"type": "block-start", "index": 0, "blockType": "text"},
        {"type": "text-delta", "index": 0, "text": text},
        {"type": "block-end", "index": 0, "block": {"type": "text", "text": text}},
        {"type": "usage", "usage": {"inputTokens": 10, "outputTokens": 2}},
        {"type": "finish", "reason": {"kind": finish}},
    ]


def tool_reply(*calls: tuple[str, str, str]) -> list[dict[str, Any]]:
    """Chunks of an answer made of tool calls ``(id, name, arguments)``."""
    chunks: list[dict[str, Any]] = []
    for index, (call_id, name, arguments) in enumerate(calls):
        chunks += [
            {"type": "block-start", "index": index, "blockType": "tool-call"},
            {"type": "tool-call-delta", "index": index, "id": call_id, "name": name,
             "argumentsDelta": arguments},
        ]
    chunks += [{"type": "block-end", "index": i,
                "block": {"type": "tool-call", "id": c, "name": n, "arguments": a}}
               for i, (c, n, a) in enumerate(calls)]
    chunks += [{"type": "usage", "usage": {"inputTokens": 10, "outputTokens": 5}},
               {"type": "finish", "reason": {"kind": "tool-calls"}}]
    return chunks
