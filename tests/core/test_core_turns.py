"""Turn bookkeeping and crash-repair closers exactly as dsh writes them."""

from __future__ import annotations

from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.core.log import SessionLog
from pipeline.core.repair import repair_closers
from pipeline.core.turns import PendingCall, TurnState

FIXTURE = (SHARED_DIR / "fixtures/dsh-format0/tool-outcome-unknown.jsonl")


def test_repair_of_the_fixture_prefix_reproduces_what_dsh_wrote() -> None:
    events = read_session_file(FIXTURE).events
    log = SessionLog("s")
    log.extend(events[:5])  # ... assistant/message with a tool call, its tool/call; crash
    assert log.turn.turn == 1 and log.turn.step == 1
    assert log.turn.open_calls == (PendingCall("unknown-outcome-call", 1, 4),)
    closers = repair_closers(log)
    assert [c.to_line() for c in closers] == [e.to_line() for e in events[5:8]]
    log.extend(closers)
    assert log.turn.turn is None and log.turn.last_end_reason == {"kind": "interrupted"}
    assert repair_closers(log) == []


def _assistant_with_calls(seq: int, *call_ids: str) -> Event:
    content = [{"type": "tool-call", "id": c, "name": "t", "arguments": "{}"} for c in call_ids]
    message = {"id": f"a{seq}", "role": "assistant", "source": {"kind": "model"},
               "content": content}
    return Event("assistant/message", seq, 100 + seq, {"turn": 1, "step": 1, "message": message},
                 "append", ())


def test_calls_never_started_get_tool_not_started_and_keep_model_order() -> None:
    log = SessionLog("s")
    log.extend([Event("turn/start", 0, 100, {"turn": 1}),
                Event("step/start", 1, 101, {"turn": 1, "step": 1}),
                _assistant_with_calls(2, "c1", "c2"),
                Event("tool/call", 3, 103, {"turn": 1, "step": 1, "callId": "c2",
                                            "name": "t", "arguments": "{}"})])
    closers = repair_closers(log, time_ms=999)
    assert [c.type for c in closers] == ["tool/result", "tool/result", "step/end", "turn/end"]
    assert [c.seq for c in closers] == [4, 5, 6, 7]
    assert {c.time for c in closers} == {999}
    first, second = closers[0], closers[1]
    assert first.data["error"] == {"name": "ToolNotStartedError", "code": "TOOL_NOT_STARTED"}
    assert first.source_event_seqs is None
    assert first.data["message"]["id"] == "interrupted-tool-result-c1-4"
    assert second.data["error"]["code"] == "TOOL_OUTCOME_UNKNOWN"
    assert second.source_event_seqs == (3,)
    log.extend(closers)  # the closers are valid strict events
    assert log.turn == TurnState(turn=None, step=None, last_turn=1, last_step=1,
                                 open_calls=(), last_end_reason={"kind": "interrupted"},
                                 turns_ended=1)


def test_open_turn_without_a_step_gets_only_turn_end_at_the_last_time() -> None:
    log = SessionLog("s")
    log.append(Event("turn/start", 0, 42, {"turn": 3}))
    closers = repair_closers(log)
    assert [c.to_json() for c in closers] == [
        {"type": "turn/end", "seq": 1, "time": 42,
         "data": {"turn": 3, "reason": {"kind": "interrupted"}}}]


def test_answered_calls_and_closed_steps_leave_nothing_pending() -> None:
    log = SessionLog("s")
    log.extend([Event("turn/start", 0, 0, {"turn": 1}),
                Event("step/start", 1, 0, {"turn": 1, "step": 1}),
                _assistant_with_calls(2, "c1"),
                Event("step/end", 3, 0, {"turn": 1, "step": 1}),
                Event("step/start", 4, 0, {"turn": 1, "step": 2})])
    assert log.turn.open_calls == () and log.turn.step == 2 and log.turn.last_step == 2
    assert [c.type for c in repair_closers(log)] == ["step/end", "turn/end"]


def test_balanced_and_empty_logs_need_no_repair() -> None:
    assert repair_closers(SessionLog("s")) == []
    log = SessionLog("s")
    log.extend(read_session_file(FIXTURE).events)
    assert repair_closers(log) == []
    assert log.turn.turns_ended == 2 and log.turn.last_turn == 2
