"""Turn bookkeeping from the log, and the crash-repair closers dsh writes.

:class:`TurnState` is folded from events: the open turn and step, the last ones, the tool calls
of the open step that have no result yet, and the last end reason. It follows dsh's own
recovery fold (``interruptedTurnClosers`` of its session package): a ``turn/start`` or
``turn/end`` forgets pending calls, ``step/end`` too; an ``assistant/message`` advertises each
``tool-call`` block as pending; ``tool/call`` marks a pending call as recorded (started);
``tool/result`` settles it (matched by ``message.source.callId``).

:func:`repair_closers` gives, for a log whose last turn is open, exactly the events dsh appends
before anything else: one error ``tool/result`` per pending call in advertisement order
(``TOOL_OUTCOME_UNKNOWN`` when its ``tool/call`` was recorded, else ``TOOL_NOT_STARTED``),
``step/end`` when a step is open, then ``turn/end {kind:"interrupted"}``. Seqs continue the
log; times are the last event's time, as dsh writes them, unless the caller passes one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from pipeline.core.events import APPEND, Event, JsonValue

if TYPE_CHECKING:
    from pipeline.core.log import SessionLog

TOOL_OUTCOME_UNKNOWN: Final = "TOOL_OUTCOME_UNKNOWN"
TOOL_NOT_STARTED: Final = "TOOL_NOT_STARTED"
OUTCOME_UNKNOWN_TEXT: Final = (
    "The tool call was interrupted after it was recorded, but no result was durably recorded. "
    "Its outcome is unknown. Decide whether to retry from the tool semantics: retry only if the "
    "operation is read-only or idempotent; if it may have side effects, first verify external "
    "state or ask the user. Do not retry blindly."
)
NOT_STARTED_TEXT: Final = (
    "The tool call was interrupted before the Harness recorded it as started. "
    "Retry it if it is still needed."
)


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A tool-call block of the open step with no ``tool/result`` yet.

    ``call_seq`` is the seq of its ``tool/call`` (the call was started) or None.
    """

    call_id: str
    step: int
    call_seq: int | None = None

    @property
    def recorded(self) -> bool:
        return self.call_seq is not None


@dataclass(frozen=True, slots=True)
class TurnState:
    """Where the session stands between turns and steps (an immutable value)."""

    turn: int | None = None
    step: int | None = None
    last_turn: int = 0
    last_step: int = 0
    open_calls: tuple[PendingCall, ...] = ()
    last_end_reason: JsonValue | None = None
    turns_ended: int = 0

    @property
    def in_turn(self) -> bool:
        return self.turn is not None

    @property
    def in_step(self) -> bool:
        return self.step is not None

    def advance(self, event: Event) -> TurnState:
        """The state after ``event`` (``self`` when the event changes nothing here)."""
        handler = _HANDLERS.get(event.type)
        if handler is None or not isinstance(event.data, dict):
            return self
        return handler(self, event, event.data)


def _turn_start(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    turn = data.get("turn")
    number = turn if type(turn) is int else state.last_turn + 1
    return replace(state, turn=number, step=None, last_turn=number, last_step=0, open_calls=())


def _turn_end(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    return replace(state, turn=None, step=None, open_calls=(),
                   last_end_reason=data.get("reason"), turns_ended=state.turns_ended + 1)


def _step_start(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    step = data.get("step")
    number = step if type(step) is int else state.last_step + 1
    return replace(state, step=number, last_step=number)


def _step_end(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    return replace(state, step=None, open_calls=())


def _assistant_message(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    message = data.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return state
    raw_step = data.get("step")
    step = raw_step if type(raw_step) is int else (state.step or 0)
    calls = list(state.open_calls)
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool-call":
            call_id = block.get("id")
            if isinstance(call_id, str):
                calls = _set_call(calls, PendingCall(call_id, step))
    return replace(state, open_calls=tuple(calls)) if calls != list(state.open_calls) else state


def _set_call(calls: list[PendingCall], call: PendingCall) -> list[PendingCall]:
    """Insert or overwrite by call id, keeping first-insertion order (a JS Map's ``set``)."""
    for index, existing in enumerate(calls):
        if existing.call_id == call.call_id:
            calls[index] = call
            return calls
    calls.append(call)
    return calls


def _tool_call(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    call_id = data.get("callId")
    for index, call in enumerate(state.open_calls):
        if call.call_id == call_id:
            calls = list(state.open_calls)
            calls[index] = replace(call, call_seq=event.seq)
            return replace(state, open_calls=tuple(calls))
    return state


def _tool_result(state: TurnState, event: Event, data: dict[str, Any]) -> TurnState:
    message = data.get("message")
    source = message.get("source") if isinstance(message, dict) else None
    call_id = source.get("callId") if isinstance(source, dict) else None
    remaining = tuple(call for call in state.open_calls if call.call_id != call_id)
    if len(remaining) == len(state.open_calls):
        return state
    return replace(state, open_calls=remaining)


_HANDLERS: Final = {
    "turn/start": _turn_start,
    "turn/end": _turn_end,
    "step/start": _step_start,
    "step/end": _step_end,
    "assistant/message": _assistant_message,
    "tool/call": _tool_call,
    "tool/result": _tool_result,
}


def fold_turns(events: list[Event] | tuple[Event, ...]) -> TurnState:
    state = TurnState()
    for event in events:
        state = state.advance(event)
    return state


def repair_closers(log: SessionLog, time_ms: int | None = None) -> list[Event]:
    """The crash-repair closers for ``log`` exactly as dsh writes them; [] if no turn is open.

    ``time_ms`` None (the default) stamps them with the last event's time, as dsh does.
    """
    state = log.turn
    if state.turn is None or not log.events:
        return []
    last = log.events[-1]
    time = last.time if time_ms is None else time_ms
    seq = log.next_seq
    closers: list[Event] = []
    for call in state.open_calls:
        closers.append(_closer_result(state.turn, call, seq, time))
        seq += 1
    if state.step is not None:
        closers.append(Event("step/end", seq, time, {"turn": state.turn, "step": state.step}))
        seq += 1
    closers.append(Event("turn/end", seq, time,
                         {"turn": state.turn, "reason": {"kind": "interrupted"}}))
    return closers


def _closer_result(turn: int, call: PendingCall, seq: int, time: int) -> Event:
    started = call.recorded
    message = {
        "id": f"interrupted-tool-result-{call.call_id}-{seq}",
        "role": "user",
        "source": {"kind": "tool", "callId": call.call_id},
        "content": [{
            "type": "tool-result",
            "toolCallId": call.call_id,
            "isError": True,
            "content": [{"type": "text",
                         "text": OUTCOME_UNKNOWN_TEXT if started else NOT_STARTED_TEXT}],
        }],
    }
    error = ({"name": "ToolOutcomeUnknownError", "code": TOOL_OUTCOME_UNKNOWN} if started
             else {"name": "ToolNotStartedError", "code": TOOL_NOT_STARTED})
    data = {"turn": turn, "step": call.step, "message": message, "error": error}
    sources = (call.call_seq,) if call.call_seq is not None else None
    return Event("tool/result", seq, time, data, APPEND, sources)
