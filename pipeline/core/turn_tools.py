"""The tool calls of one step: which started, which finished, which results are due.

Results enter the log in model order: a result is *due* once every earlier call has its
result, whatever order the calls finish in. A call that never started (cancel, truncated
output) is answered with an error result that has no ``sourceEventSeqs``, as crash repair
does for a call with no ``tool/call``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pipeline.core.errors import TurnError
from pipeline.core.events import JsonValue
from pipeline.core.model import tool_calls_of
from pipeline.core.turn_effects import ToolCall, ToolOutcome


def calls_of(content: Iterable[JsonValue]) -> list[ToolCall]:
    """The tool calls of an assistant message's content, in model order."""
    return [ToolCall(str(b["id"]), str(b["name"]), str(b["arguments"]))
            for b in tool_calls_of(content)]


@dataclass(frozen=True, slots=True)
class DueResult:
    call: ToolCall
    outcome: ToolOutcome
    sources: tuple[int, ...] | None


@dataclass(slots=True)
class ToolRound:
    calls: list[ToolCall] = field(default_factory=list)
    started: dict[str, int] = field(default_factory=dict)  # call id -> seq of its tool/call
    outcomes: dict[str, ToolOutcome] = field(default_factory=dict)
    logged: int = 0  # results logged so far (a prefix of ``calls``)
    dispatched: bool = False
    approved: set[str] = field(default_factory=set)  # recorded, approved, not yet running

    def pending(self) -> list[ToolCall]:
        """The calls to (re)dispatch: without an outcome, and not started or approved."""
        return [call for call in self.calls[self.logged:] if call.call_id not in self.outcomes
                and (call.call_id not in self.started or call.call_id in self.approved)]

    @property
    def answered(self) -> bool:
        return self.logged == len(self.calls)

    def call(self, call_id: str) -> ToolCall:
        for call in self.calls:
            if call.call_id == call_id:
                return call
        raise TurnError(f"no tool call {call_id!r} in this step")

    def start(self, call_id: str) -> ToolCall:
        call = self.call(call_id)
        if call_id in self.started:
            raise TurnError(f"tool call {call_id!r} started twice")
        return call

    def finish(self, call_id: str, outcome: ToolOutcome) -> list[DueResult]:
        """Record an outcome; the results now due, in model order."""
        self.call(call_id)
        if call_id not in self.started:
            raise TurnError(f"tool call {call_id!r} finished without having started")
        self.outcomes[call_id] = outcome
        due: list[DueResult] = []
        for call in self.calls[self.logged:]:
            if call.call_id not in self.outcomes:
                break
            due.append(DueResult(call, self.outcomes[call.call_id],
                                 (self.started[call.call_id],)))
        return due

    def unanswered(self, error: Mapping[str, str], text: str) -> list[DueResult]:
        """Results for every call still without one (none may be running)."""
        due: list[DueResult] = []
        for call in self.calls[self.logged:]:
            if call.call_id in self.started and call.call_id not in self.outcomes:
                raise TurnError(f"tool call {call.call_id!r} is still running")
            outcome = self.outcomes.get(call.call_id) or ToolOutcome.failure(
                text, name=error["name"], code=error["code"])
            started = self.started.get(call.call_id)
            due.append(DueResult(call, outcome, None if started is None else (started,)))
        return due


def tool_result_data(turn: int, step: int, result: DueResult, message_id: str
                     ) -> dict[str, JsonValue]:
    """The ``tool/result`` data: a user-role message with exactly one tool-result block."""
    outcome, call_id = result.outcome, result.call.call_id
    block: dict[str, JsonValue] = {"type": "tool-result", "toolCallId": call_id,
                                   "content": list(outcome.content), "isError": outcome.is_error}
    message = {"id": message_id, "role": "user", "source": {"kind": "tool", "callId": call_id},
               "content": [block]}
    data: dict[str, JsonValue] = {"turn": turn, "step": step, "message": message}
    if outcome.error is not None:
        data["error"] = dict(outcome.error)
    if outcome.meta is not None:
        data["meta"] = outcome.meta
    return data
