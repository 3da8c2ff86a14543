"""The lifecycle of a turn, folded once: which events open and close a turn and a step, the
numbers they declare and how the last turn ended.

:class:`Lifecycle` is the fold (an immutable value): ``turn/start`` opens a turn (and closes
any step), ``step/start`` opens a step, ``step/end`` closes it, ``turn/end`` closes both and
keeps its reason. A boundary whose number is missing continues the count (the last turn or
step + 1); a boundary whose data is not an object changes nothing. These are dsh's own rules
(its session package's recovery fold): :class:`pipeline.core.turns.TurnState` is a
:class:`Lifecycle` plus the open tool calls.

The readers that cannot hold the fold itself read a boundary with the helpers here, so a
number or an end reason means the same everywhere: :func:`declared_number` and
:func:`end_reason_kind` (the fleet row, which is persisted and restored without a fold
behind it; the dashboard's end-reason chart and metric; the driver's metrics). The GenAI
trace (:mod:`pipeline.core.genai_trace`) keys its spans by the numbers the events carry and
keeps its own reading of them. ``tests/core/test_lifecycle_agreement.py`` checks that all of them
say the same as the fold after every event of the recorded logs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, TypeVar

from pipeline.core.events import Event, JsonValue

TURN_START: Final = "turn/start"
TURN_END: Final = "turn/end"
STEP_START: Final = "step/start"
STEP_END: Final = "step/end"
BOUNDARY_TYPES: Final = frozenset({TURN_START, TURN_END, STEP_START, STEP_END})

_Fold = TypeVar("_Fold", bound="Lifecycle")


def declared_number(data: Mapping[str, JsonValue], key: str) -> int | None:
    """The turn or step number a boundary's data declares (``key``); None when it declares
    none, or not as an integer (a JSON ``true`` is no number)."""
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def end_reason_kind(reason: JsonValue | None) -> str | None:
    """The ``kind`` of a ``turn/end`` reason (``completed``, ``aborted``, ``error``, ...);
    None when the reason is not an object with a string kind."""
    kind = reason.get("kind") if isinstance(reason, Mapping) else None
    return kind if isinstance(kind, str) else None


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """Where a session stands between turns and steps: the open turn and step (None when
    closed), the last ones, the last turn's end reason and how many turns ended."""

    turn: int | None = None
    step: int | None = None
    last_turn: int = 0
    last_step: int = 0
    last_end_reason: JsonValue | None = None
    turns_ended: int = 0

    @property
    def in_turn(self) -> bool:
        return self.turn is not None

    @property
    def in_step(self) -> bool:
        return self.step is not None

    @property
    def last_end_kind(self) -> str | None:
        return end_reason_kind(self.last_end_reason)

    def advance(self: _Fold, event: Event) -> _Fold:
        """The fold after ``event`` (``self`` when the event is no boundary, or its data is
        not an object). A subclass's extra fields are carried as they are."""
        handler = _BOUNDARIES.get(event.type)
        if handler is None or not isinstance(event.data, dict):
            return self
        folded: _Fold = handler(self, event.data)  # each handler returns replace(self, ...)
        return folded


def _turn_start(state: _Fold, data: dict[str, Any]) -> _Fold:
    number = declared_number(data, "turn")
    number = state.last_turn + 1 if number is None else number
    return replace(state, turn=number, step=None, last_turn=number, last_step=0)


def _turn_end(state: _Fold, data: dict[str, Any]) -> _Fold:
    return replace(state, turn=None, step=None, last_end_reason=data.get("reason"),
                   turns_ended=state.turns_ended + 1)


def _step_start(state: _Fold, data: dict[str, Any]) -> _Fold:
    number = declared_number(data, "step")
    number = state.last_step + 1 if number is None else number
    return replace(state, step=number, last_step=number)


def _step_end(state: _Fold, data: dict[str, Any]) -> _Fold:
    return replace(state, step=None)


_BOUNDARIES: Final[dict[str, Callable[[Any, dict[str, Any]], Any]]] = {
    TURN_START: _turn_start, TURN_END: _turn_end, STEP_START: _step_start, STEP_END: _step_end,
}


def fold_lifecycle(events: list[Event] | tuple[Event, ...]) -> Lifecycle:
    state = Lifecycle()
    for event in events:
        state = state.advance(event)
    return state
