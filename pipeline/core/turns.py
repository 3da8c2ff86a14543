"""Turn bookkeeping from the log.

:class:`TurnState` is the turn lifecycle (:class:`pipeline.core.lifecycle.Lifecycle`: the open
turn and step, the last ones, the last end reason) plus the tool calls of the open step that
have no result yet. It follows dsh's own recovery fold (``interruptedTurnClosers`` of its
session package): a ``turn/start`` or ``turn/end`` forgets pending calls, ``step/end`` too; an
``assistant/message`` advertises each ``tool-call`` block as pending; ``tool/call`` marks a
pending call as recorded (started); ``tool/result`` settles it (matched by
``message.source.callId``). The closers dsh writes for an open turn are
:func:`pipeline.core.repair.repair_closers`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

from pipeline.core.errors import CodecError
from pipeline.core.events import Event, JsonValue
from pipeline.core.lifecycle import BOUNDARY_TYPES, STEP_END, TURN_END, TURN_START, Lifecycle


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
class TurnState(Lifecycle):
    """Where the session stands between turns and steps, and its unanswered tool calls (an
    immutable value)."""

    open_calls: tuple[PendingCall, ...] = ()

    def advance(self, event: Event) -> TurnState:
        """The state after ``event`` (``self`` when the event changes nothing here)."""
        handler = _CALL_HANDLERS.get(event.type)
        if handler is not None:
            return handler(self, event, event.data) if isinstance(event.data, dict) else self
        if event.type not in BOUNDARY_TYPES:
            return self  # the many chunks, and every other type: nothing to fold here
        state = Lifecycle.advance(self, event)
        # A boundary that opens a turn or closes a step forgets the step's calls.
        forget = state is not self and event.type in _FORGETS_CALLS and state.open_calls
        return replace(state, open_calls=()) if forget else state

    def to_json(self) -> dict[str, JsonValue]:
        """Every field (camelCase); open calls as ``[callId, step, callSeq|null]``."""
        return {"turn": self.turn, "step": self.step, "lastTurn": self.last_turn,
                "lastStep": self.last_step,
                "openCalls": [[c.call_id, c.step, c.call_seq] for c in self.open_calls],
                "lastEndReason": self.last_end_reason, "turnsEnded": self.turns_ended}

    @classmethod
    def from_json(cls, raw: JsonValue) -> TurnState:
        """The state :meth:`to_json` gave; :class:`CodecError` when a field does not fit."""
        if not isinstance(raw, dict):
            raise CodecError("a turn state must be a JSON object")
        try:
            calls = tuple(_pending_call(entry) for entry in raw["openCalls"])
            state = cls(turn=_int_or_none(raw["turn"]), step=_int_or_none(raw["step"]),
                        last_turn=_int(raw["lastTurn"]), last_step=_int(raw["lastStep"]),
                        open_calls=calls, last_end_reason=raw["lastEndReason"],
                        turns_ended=_int(raw["turnsEnded"]))
        except (KeyError, TypeError, ValueError) as error:
            raise CodecError(f"a turn state needs turn, step, lastTurn, lastStep, openCalls, "
                             f"lastEndReason and turnsEnded of the right types ({error})"
                             ) from None
        return state


def _int(value: JsonValue) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an integer")
    return value


def _int_or_none(value: JsonValue) -> int | None:
    return None if value is None else _int(value)


def _pending_call(entry: JsonValue) -> PendingCall:
    call_id, step, call_seq = entry
    if not isinstance(call_id, str):
        raise TypeError(f"call id {call_id!r} is not a string")
    return PendingCall(call_id, _int(step), _int_or_none(call_seq))


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


_FORGETS_CALLS: Final = frozenset({TURN_START, TURN_END, STEP_END})
_CALL_HANDLERS: Final = {
    "assistant/message": _assistant_message,
    "tool/call": _tool_call,
    "tool/result": _tool_result,
}


def fold_turns(events: list[Event] | tuple[Event, ...]) -> TurnState:
    state = TurnState()
    for event in events:
        state = state.advance(event)
    return state
