"""The derived-messages change records: rebuilding from the compacted topic equals core's
derivation, on the recorded fixtures and on random append/replace sequences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_paths import SHARED_DIR

from pipeline.codec.sessionfile import read_session_file
from pipeline.core.errors import EventError
from pipeline.core.events import Event, Replace
from pipeline.core.log import derive_messages
from pipeline.core.projection import (
    fold_slots,
    parse_slot_key,
    rebuild_conversations,
    slot_key,
    with_session,
)
from pipeline.core.surface import SurfaceFold


def slot_fold() -> SurfaceFold:
    return SurfaceFold(keep_messages=False)

FIXTURES = (SHARED_DIR / "fixtures")
LOGS = [*sorted((FIXTURES / "dsh-format0").glob("*.jsonl")), FIXTURES / "seed-example.jsonl"]


def fold_to_records(session_id: str, events: list[Event]) -> list[tuple[str, Any]]:
    """The (key, value) records the processors publish for these events, in order."""
    slots = slot_fold()
    records: list[tuple[str, Any]] = []
    for event in events:
        changes = fold_slots(slots, event)
        records += [(c.key, c.to_json()) for c in with_session(changes, session_id)]
    return records


def compact(records: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """What log compaction may leave: the last record per key (tombstones removed)."""
    last = dict(records)
    return [(k, v) for k, v in last.items() if v is not None]


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.stem)
def test_fixture_changes_rebuild_the_recorded_derivation(path: Path) -> None:
    events = list(read_session_file(path).events)
    expected = json.loads(path.with_name(path.stem + ".derived.json").read_text())
    records = fold_to_records("s-1", events)
    assert rebuild_conversations(records)["s-1"] == expected
    assert rebuild_conversations(compact(records))["s-1"] == expected


def _msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


@st.composite
def surface_logs(draw: st.DrawFn) -> list[Event]:
    """Random logs of user messages appended or replacing a live range."""
    events: list[Event] = []
    live: list[int] = []
    for seq in range(draw(st.integers(1, 40))):
        if live and draw(st.booleans()):
            i = draw(st.integers(0, len(live) - 1))
            j = draw(st.integers(i, min(len(live) - 1, i + 3)))
            removed = live[i:j + 1]
            live[i:j + 1] = [seq]
            events.append(Event("user/message", seq, seq, _msg(f"r{seq}"),
                                Replace(removed[0], removed[-1]), tuple(removed)))
        elif draw(st.integers(0, 4)) == 0:
            events.append(Event("step/start", seq, seq, {"turn": 1, "step": seq}))
        else:
            live.append(seq)
            events.append(Event("user/message", seq, seq, _msg(f"m{seq}"), "append"))
    return events


@settings(max_examples=150, deadline=None)
@given(surface_logs())
def test_random_replaces_rebuild_equals_core_derivation(events: list[Event]) -> None:
    records = fold_to_records("s", events)
    expected = list(derive_messages(events))
    assert rebuild_conversations(records).get("s", []) == expected
    assert rebuild_conversations(compact(records)).get("s", []) == expected


@settings(max_examples=60, deadline=None)
@given(surface_logs())
def test_the_serialised_state_is_the_live_surface_and_folds_on_like_core(
        events: list[Event]) -> None:
    slots = slot_fold()
    for event in events[:len(events) // 2]:
        fold_slots(slots, event)
    raw = json.loads(json.dumps(slots.to_json()))
    assert [node[1] for node in raw] == list(slots.seqs())   # live nodes, nothing else
    again = SurfaceFold.from_json(raw)
    records = []
    for event in events[len(events) // 2:]:
        records += [(c.key, c.to_json()) for c in with_session(fold_slots(again, event), "s")]
    before = fold_to_records("s", events[:len(events) // 2])
    assert rebuild_conversations(before + records).get("s", []) == list(derive_messages(events))


def test_state_survives_a_json_round_trip() -> None:
    slots = slot_fold()
    fold_slots(slots, Event("user/message", 0, 0, _msg("a"), "append"))
    again = SurfaceFold.from_json(json.loads(json.dumps(slots.to_json())))
    changes = fold_slots(again, Event("user/message", 1, 1, _msg("b"), Replace(0, 0), (0,)))
    assert [(c.kind, c.slot, c.seq) for c in changes] == [("replace", 0, 1)]


def test_the_earlier_state_form_is_read_without_its_op_log() -> None:
    again = SurfaceFold.from_json({"nodes": [[0, 0], [1, 3]], "ops": [[0], [1], [3, 1, 1]]})
    assert again.slots() == [[0, 0], [1, 3]]
    changes = fold_slots(again, Event("user/message", 4, 4, _msg("c"), Replace(3, 3), (3,)))
    assert [(c.kind, c.slot, c.seq) for c in changes] == [("replace", 1, 4)]


def test_replace_of_a_seq_not_on_the_surface_is_refused_and_changes_nothing() -> None:
    slots = slot_fold()
    fold_slots(slots, Event("user/message", 0, 0, _msg("a"), "append"))
    with pytest.raises(EventError, match="seq 7 is not a live surface node"):
        fold_slots(slots, Event("user/message", 1, 1, _msg("b"), Replace(7, 7), (7,)))
    assert slots.seqs() == (0,)


def test_the_slot_view_keeps_every_rule_of_core_s_fold() -> None:
    slots = slot_fold()
    for seq in range(3):
        fold_slots(slots, Event("user/message", seq, 0, _msg(str(seq)), "append"))
    with pytest.raises(EventError, match="sourceEventSeqs must name every shadowed node"):
        fold_slots(slots, Event("user/message", 3, 0, _msg("x"), Replace(0, 1), (0,)))
    assert slots.seqs() == (0, 1, 2)


def test_replace_emits_one_record_plus_one_tombstone_per_other_removed_node() -> None:
    slots = slot_fold()
    for seq in range(4):
        fold_slots(slots, Event("user/message", seq, 0, _msg(str(seq)), "append"))
    changes = with_session(
        fold_slots(slots, Event("user/message", 4, 0, _msg("x"), Replace(1, 2), (1, 2))), "s")
    assert [(c.key, c.to_json() is None) for c in changes] == [
        (slot_key("s", 1), False), (slot_key("s", 2), True)]
    assert slots.seqs() == (0, 4, 3)


def test_slot_keys_sort_in_surface_order_and_parse_back() -> None:
    assert slot_key("a/b", 12) < slot_key("a/b", 100)
    assert parse_slot_key(slot_key("a/b", 12)) == ("a/b", 12)
    with pytest.raises(EventError, match="not '<session>/<slot>'"):
        parse_slot_key("no-slot")


def _tool_result(seq: int, text: str, call_id: str = "c1", op: Any = "append",
                 sources: tuple[int, ...] | None = None) -> Event:
    message = {"id": f"r-{call_id}", "role": "user", "source": {"kind": "tool", "callId": call_id},
               "content": [{"type": "tool-result", "toolCallId": call_id,
                            "content": [{"type": "text", "text": text}]}]}
    return Event("tool/result", seq, seq, {"turn": 1, "step": 1, "message": message}, op,
                 sources)


def test_tool_result_replacement_rules_hold_across_a_state_round_trip() -> None:
    slots = slot_fold()
    fold_slots(slots, _tool_result(0, "a very long output"))
    again = SurfaceFold.from_json(json.loads(json.dumps(slots.to_json())))
    with pytest.raises(EventError, match="may change only the result's content"):
        fold_slots(again, _tool_result(1, "short", call_id="c2", op=Replace(0, 0), sources=(0,)))
    changes = fold_slots(again, _tool_result(1, "[spilled]", op=Replace(0, 0), sources=(0,)))
    assert [(c.kind, c.slot) for c in changes] == [("replace", 0)]
    fold_slots(again, Event("user/message", 2, 2, _msg("u"), "append"))
    with pytest.raises(EventError, match="must shadow a tool/result"):
        fold_slots(again, _tool_result(3, "x", op=Replace(2, 2), sources=(2,)))
