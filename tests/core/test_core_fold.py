"""The incremental fold equals a fresh fold at every prefix; changes say exactly what changed."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import valid_logs

from pipeline.core.errors import EventError
from pipeline.core.events import Event, Replace
from pipeline.core.log import SessionLog, derive_messages
from pipeline.core.surface import Appended, Replaced, SurfaceFold
from pipeline.core.turns import fold_turns

FOLD_SETTINGS = settings(max_examples=100, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow])


def fresh_surface(events: list[Event]) -> list[int]:
    """The surface by the definition, naively: appends and list splices over seqs."""
    nodes: list[int] = []
    for event in events:
        op = event.surface_op
        if op is None or event.type not in ("user/message", "assistant/message", "tool/result"):
            continue
        if isinstance(op, Replace):
            start, end = nodes.index(op.start), nodes.index(op.end)
            nodes[start:end + 1] = [event.seq]
        else:
            nodes.append(event.seq)
    return nodes


@FOLD_SETTINGS
@given(valid_logs())
def test_incremental_fold_equals_fresh_fold_at_every_prefix(events: list[Event]) -> None:
    log = SessionLog("s", mode="strict")
    for k, event in enumerate(events):
        log.append(event)
        prefix = events[:k + 1]
        assert log.messages() == derive_messages(prefix, mode="strict")
        assert [node.seq for node in log.surface()] == fresh_surface(prefix)
        assert log.turn == fold_turns(prefix)
    for k in range(-1, len(events)):
        assert log.messages_at(k) == derive_messages(events[:k + 1])


@FOLD_SETTINGS
@given(valid_logs())
def test_surface_changes_replayed_on_a_mirror_give_the_messages(events: list[Event]) -> None:
    """What a processor does: keep a mirror list from the changes alone."""
    fold = SurfaceFold()
    mirror: list[tuple[int, Any]] = []
    for event in events:
        change = fold.apply(event)
        if isinstance(change, Appended):
            assert change.position == len(mirror)
            mirror.append((change.seq, change.message))
        elif isinstance(change, Replaced):
            removed = mirror[change.start_position:change.start_position
                             + len(change.removed_seqs)]
            assert tuple(seq for seq, _ in removed) == change.removed_seqs
            mirror[change.start_position:change.start_position + len(removed)] = [
                (change.seq, change.message)]
        assert tuple(m for _, m in mirror if m is not None) == fold.messages()


@FOLD_SETTINGS
@given(valid_logs(prefix=False), st.data())
def test_a_refused_event_leaves_no_partial_state(events: list[Event], data: st.DataObject
                                                 ) -> None:
    index = data.draw(st.integers(0, len(events) - 1))
    log = SessionLog("s")
    log.extend(events[:index])
    before = (log.next_seq, log.messages(), log.turn, log.surface())
    original = events[index]
    broken = data.draw(st.sampled_from([
        Event(original.type, original.seq, original.time, {"bad": float("inf")}),
        Event(original.type, original.seq + 1, original.time, original.data),
        Event("user/message", original.seq, 0, {"id": "x"}, Replace(0, 0), (0,)),
    ]))
    try:
        log.append(broken)
    except EventError:
        assert (log.next_seq, log.messages(), log.turn, log.surface()) == before
        log.extend(events[index:])  # and the log goes on as if nothing happened
        assert log.messages() == derive_messages(events, mode="strict")


def test_messages_are_shared_not_copied_and_results_are_tuples() -> None:
    data = {"id": "u", "role": "user", "source": {"kind": "user"}, "content": []}
    log = SessionLog("s")
    log.append(Event("user/message", 0, 0, data, "append"))
    messages = log.messages()
    assert isinstance(messages, tuple) and messages[0] is data
    assert isinstance(log.surface(), tuple)
    assert log.messages() is messages  # cached until the surface changes


def test_empty_assistant_message_joins_the_surface_but_projects_nothing() -> None:
    message = {"id": "a", "role": "assistant", "source": {"kind": "model"}, "content": []}
    fold = SurfaceFold()
    change = fold.apply(Event("assistant/message", 0, 0,
                              {"turn": 1, "step": 1, "message": message}, "append", ()))
    assert change == Appended(0, 0, None)
    assert fold.messages() == () and len(fold) == 1


def test_replace_reports_position_removed_seqs_and_new_message() -> None:
    def user(seq: int, op: Any = "append", sources: tuple[int, ...] | None = None) -> Event:
        return Event("user/message", seq, 0, {"id": f"u{seq}", "role": "user",
                                              "source": {"kind": "user"}, "content": []},
                     op, sources)
    fold = SurfaceFold()
    for seq in range(4):
        fold.apply(user(seq))
    change = fold.apply(user(4, Replace(1, 2), (1, 2)))
    assert change == Replaced(1, (1, 2), 4, copy.deepcopy(user(4).data))
    assert fold.seqs() == (0, 4, 3)
    change = fold.apply(user(5, Replace(3, 3), (3,)))
    assert change == Replaced(2, (3,), 5, user(5).data)
    assert fold.seqs() == (0, 4, 5)


def test_messages_at_with_checkpoints_in_any_query_order(monkeypatch: Any) -> None:
    import random

    import pipeline.core.log as log_module
    from dsh_dev.synth import synth_session
    monkeypatch.setattr(log_module, "CHECKPOINT_EVERY", 4)
    events = synth_session(21, 3000)
    log = SessionLog("s")
    log.extend(events)
    rng = random.Random(5)
    fresh = SessionLog("fresh")
    expected: dict[int, Any] = {}
    for event in events:  # every prefix's messages, computed incrementally once
        fresh.append(event)
        expected[event.seq] = fresh.messages()
    for seq in [rng.randrange(len(events)) for _ in range(300)] + [0, 2999, 1, 2998]:
        assert log.messages_at(seq) == expected[seq], seq
