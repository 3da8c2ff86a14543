"""Fleet status per session and fleet counters."""

from __future__ import annotations

from pathlib import Path

from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.core.fleet import IDLE, IN_TURN, FleetStatus, StepRate, fleet_counters

FIXTURES = (SHARED_DIR / "fixtures/dsh-format0")


def fold(path: Path, upto: int | None = None) -> FleetStatus:
    status = FleetStatus("s")
    for event in read_session_file(path).events[:upto]:
        if event.type != "assistant/chunk":
            status.apply(event)
    return status


def test_completed_tool_turn_is_idle_with_its_end_reason_and_counts() -> None:
    status = fold(FIXTURES / "tool-call-turn.jsonl")
    assert (status.state, status.turn, status.step) == (IDLE, 1, None)
    assert status.last_end_reason == "completed"
    assert (status.turns, status.steps, status.turn_errors) == (1, 2, 0)
    assert FleetStatus.from_json(status.to_json()) == status


def test_cancelled_turn_ends_aborted() -> None:
    assert fold(FIXTURES / "cancel.jsonl").last_end_reason == "aborted"


def test_crash_repair_counts_the_unknown_tool_outcome_as_a_tool_error() -> None:
    status = fold(FIXTURES / "tool-outcome-unknown.jsonl")
    assert status.tool_errors == 1 and status.last_error == "TOOL_OUTCOME_UNKNOWN"


def test_mid_step_status_and_error_end() -> None:
    status = FleetStatus("s")
    status.apply(Event("turn/start", 0, 10, {"turn": 3}))
    status.apply(Event("step/start", 1, 11, {"turn": 3, "step": 2}))
    assert (status.state, status.turn, status.step, status.last_activity_ms) == (IN_TURN, 3, 2, 11)
    status.apply(Event("llm/retry", 2, 12, {"attempt": 1}))
    status.apply(Event("turn/end", 3, 13, {"turn": 3, "reason": {
        "kind": "error", "error": {"message": "x", "code": "RATE_LIMIT"}}}))
    assert (status.state, status.last_end_reason, status.last_error) == (IDLE, "error",
                                                                         "RATE_LIMIT")
    assert (status.turn_errors, status.retries, status.last_seq) == (1, 1, 3)


def test_counters_over_sessions() -> None:
    busy = FleetStatus("a", state=IN_TURN, step=1, last_activity_ms=0)
    recent = FleetStatus("b", last_activity_ms=9_500, turn_errors=2)
    old = FleetStatus("c", last_activity_ms=1_000)
    counters = fleet_counters([busy, recent, old], now_ms=10_000, active_within_ms=1_000)
    assert (counters.sessions, counters.active_sessions, counters.turns_in_flight,
            counters.steps_in_flight, counters.turn_errors) == (3, 2, 1, 1, 2)


def test_step_rate_over_the_span() -> None:
    rate = StepRate(span_ms=10_000)
    assert rate.per_second() == 0.0
    rate.observe(0, 0)
    rate.observe(2_000, 10)
    assert rate.per_second() == 5.0


def test_every_event_but_a_chunk_is_worth_publishing() -> None:
    status = FleetStatus("s1")
    assert status.apply(Event("turn/start", 0, 10, {"turn": 0}))
    assert not status.apply(Event("assistant/chunk", 1, 11, {"turn": 0, "step": 0, "chunk": {}}))
    # an event the status does not read still moves its last seq and activity: published
    assert status.apply(Event("agent/inbox/spliced", 2, 12, {"inserted": []}))
    assert (status.last_seq, status.last_activity_ms) == (2, 12)
