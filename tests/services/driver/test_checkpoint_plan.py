"""Which checkpoints a transaction writes, and the tail mark it commits (no broker).

``checkpoint_plan.py``: a session's checkpoint goes with a transaction at a rest point, when it
is wanted (eviction, close), or when its first newer event is ``tail_records`` behind the end;
the tail mark is at or below the first newer event of every dirty session, only rises, and is
committed again after rising by ``tail_slack`` or when no session is dirty.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.checkpoint import SessionCheckpoint
from pipeline.services.driver.checkpoint_plan import CheckpointPlan, at_rest

SAMPLE = Path(__file__).resolve().parents[3] / "samples" / "sessions" / "tool-calls.jsonl"


def in_turn(session_id: str) -> SessionCheckpoint:
    """A checkpoint in the middle of a turn (up to its first ``step/end``)."""
    events = read_session_file(SAMPLE).events
    end = next(n for n, e in enumerate(events) if e.type == "step/end")
    checkpoint = SessionCheckpoint(session_id)
    checkpoint.advance(events[:end + 1])
    assert checkpoint.turn.in_turn
    return checkpoint


def commit(plan: CheckpointPlan, touched: list[str], folds: dict[str, SessionCheckpoint],
           end: int, *, closing: bool = False) -> tuple[list[str], int | None]:
    chosen = plan.choose(touched, folds, closing=closing)
    mark = plan.mark_for(touched, chosen)
    plan.committed(touched, chosen, end)
    return chosen, mark


def test_rest_points_are_idle_sessions_and_approval_waits() -> None:
    assert at_rest(SessionCheckpoint("idle"))
    assert not at_rest(in_turn("busy"))


def test_a_session_in_a_turn_is_dirty_and_the_mark_covers_its_events() -> None:
    plan = CheckpointPlan(mark=None, tail_records=1000, tail_slack=100)
    plan.resume([], 500)  # a takeover found the session partition ending at 500
    folds = {"a": in_turn("a"), "b": SessionCheckpoint("b")}
    chosen, mark = commit(plan, ["a", "b"], folds, end=520)
    assert chosen == ["b"]  # at rest: written; "a" in a turn: not
    assert mark == 500  # a's events of this transaction are at or after 500
    assert plan.dirty == {"a": 500}
    chosen, mark = commit(plan, ["a"], folds, end=560)
    assert (chosen, mark) == ([], 500)
    folds["a"] = SessionCheckpoint("a")  # its turn ended
    chosen, mark = commit(plan, ["a"], folds, end=580)
    assert (chosen, mark) == (["a"], None)  # nothing dirty: no tail to read
    assert plan.clean("a")


def test_the_mark_rises_by_the_slack_and_old_sessions_are_checkpointed() -> None:
    plan = CheckpointPlan(mark=None, tail_records=1000, tail_slack=100)
    plan.resume([], 0)
    folds = {"a": in_turn("a"), "b": in_turn("b")}
    assert commit(plan, ["a"], folds, end=50)[1] == 0
    assert commit(plan, ["b"], folds, end=120)[1] == 0  # b dirty from 50
    assert commit(plan, [], folds, end=120)[1] == 0  # the exact mark (0) has not moved
    plan.want("a")  # leaving memory
    chosen, mark = commit(plan, [], folds, end=120)
    assert chosen == ["a"]
    assert mark == 0  # b's first newer event is at 50: 50 below the slack, not committed
    assert commit(plan, ["b"], folds, end=1200)[1] == 0
    chosen, mark = commit(plan, [], folds, end=1200)  # b is 1150 behind the end: too old
    assert (chosen, mark) == (["b"], None)


def test_closing_writes_every_dirty_session() -> None:
    plan = CheckpointPlan(mark=None)
    plan.resume([], 0)
    folds = {"a": in_turn("a")}
    commit(plan, ["a"], folds, end=10)
    chosen, mark = commit(plan, [], folds, end=10, closing=True)
    assert (chosen, mark) == (["a"], None)


def test_a_takeover_keeps_the_mark_it_found_until_its_sessions_are_written() -> None:
    plan = CheckpointPlan(mark=40, tail_slack=100)
    plan.resume(["a"], 300)
    folds = {"a": in_turn("a"), "b": in_turn("b")}
    assert commit(plan, ["b"], folds, end=320)[1] == 40
    folds["a"] = SessionCheckpoint("a")
    chosen, mark = commit(plan, ["a"], folds, end=330)
    assert chosen == ["a"]
    assert mark == 300  # b's newer events start at or after 300 (rose by 260 >= slack)


def test_without_a_known_end_every_touched_session_is_written() -> None:
    plan = CheckpointPlan(mark=None)
    folds = {"a": in_turn("a")}
    chosen, mark = commit(plan, ["a"], folds, end=10)
    assert (chosen, mark) == (["a"], None)
