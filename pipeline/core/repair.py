"""The crash-repair closers dsh writes for a log whose last turn is open.

:func:`repair_closers` gives exactly the events dsh appends before anything else: one error
``tool/result`` per pending call in advertisement order (``TOOL_OUTCOME_UNKNOWN`` when its
``tool/call`` was recorded, else ``TOOL_NOT_STARTED``), ``step/end`` when a step is open, then
``turn/end {kind:"interrupted"}``. Seqs continue the log; times are the last event's time, as
dsh writes them, unless the caller passes one.

A turn that waits for a person's approval of a tool call (:mod:`pipeline.core.approvals`) is not
interrupted work: it gets no closers and goes on waiting (DESIGN.md section 4).
"""

from __future__ import annotations

from typing import Final

from pipeline.core.approvals import waiting_approval
from pipeline.core.events import APPEND, Event
from pipeline.core.log import SessionLog
from pipeline.core.turn_approvals import resume_wait
from pipeline.core.turns import PendingCall

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


def repair_closers(log: SessionLog, time_ms: int | None = None) -> list[Event]:
    """The crash-repair closers for ``log`` exactly as dsh writes them; [] if no turn is open
    (or it waits for approval).

    ``time_ms`` None (the default) stamps them with the last event's time, as dsh does.
    """
    state = log.turn
    if state.turn is None or not log.events:
        return []
    if resume_wait(log, waiting_approval(log.events)) is not None:
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
