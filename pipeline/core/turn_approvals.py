"""The turn machine's approval gate: asks, decisions and the wait's rebuild (sans-I/O).

The gate decides whether a call that starts needs a person (:meth:`ApprovalGate.ask`), takes
the decisions (:meth:`ApprovalGate.decide` for an inbox approve/deny, :meth:`ApprovalGate.close`
for a timeout or a cancel) and appends their events through the machine's append function.
The vocabulary and the fold are :mod:`pipeline.core.approvals`.

**The shape of a wait.** A gated call runs alone (the runner batches it by itself) and the
runner starts nothing after it, so while a turn waits its open step is: every earlier call
answered, the waiting call recorded (``tool/call``) and asked (``approval/asked``), every later
call not started. :func:`resume_wait` checks that shape on a rebuilt log and gives what the
machine needs to go on waiting; a log of any other shape is not a wait (crash repair closes
it as usual, so a call never runs twice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from pipeline.core.approvals import (
    ALLOWED,
    APPROVAL_ERROR,
    ASKED,
    CANCELLED,
    DECIDED,
    DECISION_TYPE,
    REFUSED_TYPE,
    REJECTED,
    UNAVAILABLE,
    ApprovalBook,
    ApprovalRules,
    Waiting,
    decision_data,
    denial_text,
)
from pipeline.core.events import Event, JsonValue
from pipeline.core.inbox import Approve, Deny
from pipeline.core.log import SessionLog
from pipeline.core.turn_effects import ToolCall, ToolOutcome
from pipeline.core.turn_tools import ToolRound, calls_of

Appender: TypeAlias = Callable[[str, JsonValue, int, bool], int]
"""``(type, data, now, ignorable) -> seq``: the machine's own append."""
RUN: Final = "run"
WAIT: Final = "wait"
GateAnswer: TypeAlias = Literal["run", "wait"] | ToolOutcome
_OUTCOME_OF: Final = {"approve": ALLOWED, "deny": REJECTED, "timeout": UNAVAILABLE,
                      "cancel": CANCELLED, "policy": REJECTED}


@dataclass(frozen=True, slots=True)
class ResumedWait:
    """A rebuilt wait: the open turn and step, and the round of its unanswered calls."""

    turn: int
    step: int
    tools: ToolRound


class ApprovalGate:
    """The approval state of one session's machine (rules + what its log says)."""

    def __init__(self, rules: ApprovalRules, book: ApprovalBook) -> None:
        self.rules = rules
        self.book = book

    @property
    def waiting(self) -> Waiting | None:
        return self.book.waiting

    @property
    def deadline(self) -> int | None:
        """When the open question expires (epoch ms), or None."""
        waiting, timeout = self.book.waiting, self.rules.timeout_ms
        return None if waiting is None or timeout is None else waiting.asked_at + timeout

    def needs_approval(self, tool_name: str) -> bool:
        return self.book.rule_for(self.rules, tool_name) is not None

    def ask(self, call: ToolCall, new_id: Callable[[], str], now: int, append: Appender
            ) -> GateAnswer:
        """After ``call``'s ``tool/call``: RUN it, WAIT for a person, or its denial.
        ``new_id`` makes the question's id (only when there is a question: an ungated call
        takes no id, so the ids of a log without approvals stay as they were)."""
        rule = self.book.rule_for(self.rules, call.name)
        if rule is None:
            return RUN
        question_id = new_id()
        append(ASKED, {"id": question_id, "toolName": call.name, "callId": call.call_id,
                       "reason": f'tool "{call.name}" matches the approval rule "{rule}"'},
               now, False)
        self.book.waiting = Waiting(question_id, call.call_id, call.name, now)
        if self.book.effective_policy(self.rules) == "never":  # dsh: rejected, nobody asked
            return self.close("policy", now, append)[1]
        return WAIT

    def decide(self, command: Approve | Deny, now: int, append: Appender
               ) -> tuple[str, ToolOutcome | None] | None:
        """A person's decision: ``(call id, None to run it | its denial)``; None when it is
        refused (logged as such: the call was decided already, or never waited)."""
        waiting = self.book.waiting
        decision = command.kind  # "approve" | "deny" (a Deny is an Approve subclass)
        self.book.message_ids.add(command.message_id)
        if waiting is None or waiting.call_id != command.call_id:
            refusal = self._refusal(command.call_id)
            append(REFUSED_TYPE, {"messageId": command.message_id, "callId": command.call_id,
                                  "decision": decision, "refusal": refusal}, now, True)
            return None
        outcome = self._decided(decision, now, append, message_id=command.message_id,
                                by=dict(command.source or {"kind": "user"}),
                                reason=command.reason)
        return waiting.call_id, outcome

    def close(self, decision: Literal["timeout", "cancel", "policy"], now: int,
              append: Appender) -> tuple[str, ToolOutcome]:
        """Decide the open question without a person: ``(call id, its denial)``."""
        assert self.book.waiting is not None
        call_id = self.book.waiting.call_id
        outcome = self._decided(decision, now, append)
        assert outcome is not None
        return call_id, outcome

    def _decided(self, decision: str, now: int, append: Appender, *,
                 message_id: str | None = None, by: JsonValue = None,
                 reason: str | None = None) -> ToolOutcome | None:
        waiting = self.book.waiting
        assert waiting is not None
        outcome = _OUTCOME_OF[decision]
        data = decision_data(waiting, outcome, decision, message_id=message_id, by=by,
                             reason=reason)
        append(DECISION_TYPE, data, now, True)
        append(DECIDED, {"id": waiting.id, "outcome": outcome}, now, False)
        self.book.advance(Event(DECISION_TYPE, 0, now, data))
        self.book.waiting = None
        if outcome == ALLOWED:
            return None
        text, code = denial_text(waiting.tool_name, decision, reason, self.rules.timeout_ms)
        name = "ToolCanceledError" if decision == "cancel" else APPROVAL_ERROR
        return ToolOutcome.failure(text, name=name, code=code)

    def _refusal(self, call_id: str) -> str:
        verdict = self.book.verdicts.get(call_id)
        if verdict is not None:
            return f"refused: tool call {call_id!r} was already {verdict}"
        waiting = self.book.waiting
        if waiting is not None:
            return (f"refused: tool call {call_id!r} is not waiting for approval (the session "
                    f"waits on {waiting.call_id!r})")
        return f"refused: tool call {call_id!r} is not waiting for approval"


def resume_wait(log: SessionLog, waiting: Waiting | None) -> ResumedWait | None:
    """The wait a rebuilt log holds, when its open step has the shape of one (see above)."""
    state = log.turn
    if waiting is None or state.turn is None or state.step is None or not state.open_calls:
        return None
    first, *later = state.open_calls
    if first.call_id != waiting.call_id or first.call_seq is None \
            or any(call.recorded for call in later):
        return None
    calls = _step_calls(log, state.turn, state.step)
    open_ids = {call.call_id for call in state.open_calls}
    remaining = [call for call in calls if call.call_id in open_ids]
    if [call.call_id for call in remaining] != [call.call_id for call in state.open_calls]:
        return None
    tools = ToolRound(remaining, started={first.call_id: first.call_seq}, dispatched=True)
    return ResumedWait(state.turn, state.step, tools)


def _step_calls(log: SessionLog, turn: int, step: int) -> list[ToolCall]:
    """The tool calls of the step's last assistant message (scanning back from the end)."""
    for index in range(len(log.events) - 1, -1, -1):
        event = log.events[index]
        data = event.data
        if event.type == "step/start":
            break
        if event.type == "assistant/message" and isinstance(data, Mapping) \
                and data.get("turn") == turn and data.get("step") == step:
            message = data.get("message")
            content = message.get("content") if isinstance(message, Mapping) else None
            return calls_of(content) if isinstance(content, list) else []
    return []
