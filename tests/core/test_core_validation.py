"""One test per validation rule: break it, check the error names seq, type and rule.

Each case takes a small valid strict log, changes one event (or appends one), and expects
:class:`EventError` with that rule; the log must be unchanged after the refusal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import lossless_json

from pipeline.core.errors import EventError, SequenceError
from pipeline.core.events import Event, event_from_json
from pipeline.core.log import SessionLog

Json = dict[str, Any]


def base_log() -> list[Json]:
    """A valid strict log: one turn, one step, a tool call and its result."""
    user = {"id": "u1", "role": "user", "source": {"kind": "user"},
            "content": [{"type": "text", "text": "hi"}]}
    assistant = {"id": "a1", "role": "assistant",
                 "source": {"kind": "model", "provider": "p", "model": "m"},
                 "content": [{"type": "tool-call", "id": "c1", "name": "bash",
                              "arguments": "{}"}]}
    result = {"id": "r1", "role": "user", "source": {"kind": "tool", "callId": "c1"},
              "content": [{"type": "tool-result", "toolCallId": "c1", "isError": False,
                           "content": [{"type": "text", "text": "ok"}]}]}
    return [
        {"type": "turn/start", "seq": 0, "time": 1, "data": {"turn": 1}},
        {"type": "step/start", "seq": 1, "time": 2, "data": {"turn": 1, "step": 1}},
        {"type": "user/message", "seq": 2, "time": 3, "data": user, "surfaceOp": "append"},
        {"type": "assistant/chunk", "seq": 3, "time": 4,
         "data": {"turn": 1, "step": 1,
                  "chunk": {"type": "text-delta", "index": 0, "text": "x"}}},
        {"type": "assistant/message", "seq": 4, "time": 5,
         "data": {"turn": 1, "step": 1, "message": assistant}, "surfaceOp": "append",
         "sourceEventSeqs": [3]},
        {"type": "tool/call", "seq": 5, "time": 6,
         "data": {"turn": 1, "step": 1, "callId": "c1", "name": "bash", "arguments": "{}"}},
        {"type": "tool/result", "seq": 6, "time": 7,
         "data": {"turn": 1, "step": 1, "message": result}, "surfaceOp": "append",
         "sourceEventSeqs": [5]},
        {"type": "step/end", "seq": 7, "time": 8, "data": {"turn": 1, "step": 1}},
        {"type": "turn/end", "seq": 8, "time": 9,
         "data": {"turn": 1, "reason": {"kind": "completed"}}},
    ]


def test_base_log_is_valid_in_both_modes() -> None:
    for mode in ("strict", "ingest"):
        log = SessionLog("s", mode=mode)  # type: ignore[arg-type]
        log.extend(event_from_json(obj) for obj in base_log())
        assert log.next_seq == 9


def set_in(path: str, value: Any) -> Callable[[Json], None]:
    """A mutation setting ``obj[a][b]...`` (keys split on '.', ints index lists)."""
    def mutate(obj: Json) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        target: Any = obj
        for key in parents:
            target = target[key]
        target[last] = value
    return mutate


def delete(path: str) -> Callable[[Json], None]:
    def mutate(obj: Json) -> None:
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        target: Any = obj
        for key in parents:
            target = target[key]
        del target[last]
    return mutate


def replace_tool_result(change: Callable[[Json], None]) -> Json:
    """A tool/result replacing seq 6 (valid as is), after a further change."""
    event = copy.deepcopy(base_log()[6])
    event.update(seq=9, surfaceOp={"op": "replace", "start": 6, "end": 6},
                 sourceEventSeqs=[6])
    event["data"]["message"]["content"][0]["content"] = [{"type": "text", "text": "pruned"}]
    change(event)
    return event


def user_replace(start: int, end: int, sources: list[int]) -> Json:
    event = copy.deepcopy(base_log()[2])
    event.update(seq=9, surfaceOp={"op": "replace", "start": start, "end": end},
                 sourceEventSeqs=sources)
    return event


# (rule, index of the event to change or None to append, mutation or appended event, mode)
CASES: list[tuple[str, int | None, Any, str]] = [
    ("envelope-ignorable", 0, set_in("ignorable", False), "strict"),
    ("envelope-time", 0, set_in("time", 2**60), "strict"),
    ("lossless-json", 0, set_in("data.x", float("nan")), "strict"),
    ("lossless-json", 0, set_in("data.x", -0.0), "strict"),
    ("lossless-json", 0, set_in("data.x", "\ud800"), "strict"),
    ("unknown-type", 0, set_in("type", "made/up"), "ingest"),
    ("surface-op-placement", 0, set_in("surfaceOp", "append"), "ingest"),
    ("source-seqs-placement", 1, set_in("sourceEventSeqs", [0]), "ingest"),
    ("surface-op-required", 2, delete("surfaceOp"), "strict"),
    ("replace-range", None, user_replace(9, 9, [2]), "ingest"),
    ("source-seqs-empty", 2, set_in("sourceEventSeqs", []), "ingest"),
    ("source-seqs-unique", 6, set_in("sourceEventSeqs", [5, 5]), "ingest"),
    ("source-seqs-earlier", 6, set_in("sourceEventSeqs", [6]), "ingest"),
    ("data-object", 0, set_in("data", [1]), "ingest"),
    ("turn-number", 0, set_in("data.turn", "1"), "ingest"),
    ("turn-number", 0, set_in("data.turn", True), "ingest"),
    ("step-number", 1, delete("data.step"), "ingest"),
    ("turn-end-reason", 8, set_in("data.reason", "completed"), "ingest"),
    ("chunk-shape", 3, set_in("data.chunk", "x"), "ingest"),
    ("chunk-shape", 3, delete("data.chunk.text"), "strict"),
    ("tool-call-shape", 5, set_in("data.arguments", {"a": 1}), "ingest"),
    ("message-content", 2, set_in("data.content", "hi"), "strict"),
    ("content-block", 2, set_in("data.content.0", {"text": "no type"}), "strict"),
    ("content-block", 4, delete("data.message.content.0.arguments"), "strict"),
    ("message-shape", 4, set_in("data.message", None), "ingest"),
    ("message-id", 2, delete("data.id"), "strict"),
    ("message-role", 2, set_in("data.role", "assistant"), "ingest"),
    ("message-source", 4, set_in("data.message.source", "model"), "strict"),
    ("assistant-message-shape", 4, set_in("data.interrupted", "yes"), "ingest"),
    ("tool-result-source", 6, set_in("data.message.source.kind", "user"), "ingest"),
    ("tool-result-block", 6, set_in("data.message.content", []), "ingest"),
    ("tool-result-call-id", 6, set_in("data.message.content.0.toolCallId", "c2"), "ingest"),
    ("tool-result-error", 6, set_in("data.error", {"name": "E", "code": "X"}), "strict"),
    ("request-header-shape", 1,
     lambda e: e.update(type="request/header", data={"header": "h"}), "strict"),
    ("replace-target-live", None, user_replace(1, 1, [1]), "ingest"),
    ("replace-range-order", None, user_replace(4, 2, [2, 4]), "ingest"),
    ("replace-sources", None, user_replace(2, 4, [2]), "ingest"),
    ("tool-result-replace-one", None,
     replace_tool_result(lambda e: e.update(surfaceOp={"op": "replace", "start": 4, "end": 6},
                                            sourceEventSeqs=[4, 6])), "ingest"),
    ("tool-result-replace-target", None,
     replace_tool_result(lambda e: e.update(surfaceOp={"op": "replace", "start": 2, "end": 2},
                                            sourceEventSeqs=[2])), "ingest"),
    ("tool-result-replace-content-only", None,
     replace_tool_result(set_in("data.message.id", "other")), "ingest"),
]


@pytest.mark.parametrize(("rule", "index", "change", "mode"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_is_enforced_and_named(rule: str, index: int | None, change: Any,
                                    mode: str) -> None:
    objs = base_log()
    if index is None:
        bad = change
        prefix = objs
    else:
        bad = copy.deepcopy(objs[index])
        change(bad)
        prefix = objs[:index]
    log = SessionLog("s", mode=mode)  # type: ignore[arg-type]
    log.extend(event_from_json(obj) for obj in prefix)
    before = (log.next_seq, log.messages(), log.turn, log.surface())
    with pytest.raises(EventError) as info:
        log.append(event_from_json(bad))
    error = info.value
    assert error.rule == rule
    assert error.seq == bad["seq"] and error.type == bad["type"]
    assert f"seq {bad['seq']}" in str(error) and bad["type"] in str(error)
    assert f"[rule: {rule}]" in str(error)
    assert (log.next_seq, log.messages(), log.turn, log.surface()) == before


def test_every_rule_of_the_validators_has_a_case() -> None:
    import pathlib
    import re
    sources = "".join(pathlib.Path("pipeline/core", name).read_text() for name in
                      ("validation.py", "messages.py", "surface.py"))
    # The rule is the last argument of every fail(...)/need_int(...)/need_str(...) call.
    calls = re.findall(r'(?:fail|need_int|need_str)\((?:[^()]|\([^()]*\))*?'
                       r'"([a-z]+(?:-[a-z]+)+)"\)', sources, flags=re.S)
    assert len(set(calls)) > 30
    assert set(calls) - {case[0] for case in CASES} == set()


@pytest.mark.parametrize("found", [10, 8])
def test_seq_gap_and_repeat_are_refused(found: int) -> None:
    log = SessionLog("s")
    log.extend(event_from_json(obj) for obj in base_log())
    with pytest.raises(SequenceError) as info:
        log.append(Event("turn/start", found, 0, {"turn": 2}))
    assert info.value.rule == "seq-contiguous"
    assert info.value.expected == 9 and info.value.found == found
    assert ("gap" if found > 9 else "repeat") in str(info.value)


def test_unknown_ignorable_type_is_carried_and_skipped() -> None:
    log = SessionLog("s")
    log.append(Event("x-vendor/thing", 0, 0, {"anything": [1, None]}, ignorable=True))
    assert log.next_seq == 1 and log.messages() == ()


def test_every_known_plugin_type_is_accepted_with_any_lossless_data() -> None:
    from pipeline.core.types import CORE_TYPES, PLUGIN_TYPES
    assert len(CORE_TYPES) == 13 and len(PLUGIN_TYPES) >= 35
    log = SessionLog("s")
    for seq, type_ in enumerate(sorted(PLUGIN_TYPES)):
        log.append(Event(type_, seq, 0, {"x": [seq, "y", None]}))
    assert log.next_seq == len(PLUGIN_TYPES)


def test_ingest_accepts_the_simplified_shapes_strict_refuses() -> None:
    simplified = [
        Event("user/message", 0, 0, {"role": "user", "content": [{"type": "text", "text": "a"}]},
              "append"),
        Event("assistant/message", 1, 0, {"turn": 1, "step": 1, "message": {
            "role": "assistant", "content": [{"type": "tool_use", "id": "c", "input": {}}]}},
            "append", (0,)),
        Event("tool/result", 2, 0, {"turn": 1, "step": 1, "message": {
            "role": "tool", "toolName": "bash", "content": "out", "isError": False}},
            "append"),
    ]
    log = SessionLog("s", mode="ingest")
    log.extend(simplified)
    assert len(log.messages()) == 3
    with pytest.raises(EventError):
        SessionLog("s", mode="strict").extend(simplified)


def test_surface_event_without_surface_op_stays_off_the_surface_in_ingest() -> None:
    objs = base_log()
    del objs[2]["surfaceOp"]
    log = SessionLog("s", mode="ingest")
    log.extend(event_from_json(obj) for obj in objs)
    assert [m["id"] for m in log.messages()] == ["a1", "r1"]


def test_bad_mode_and_bad_messages_at_are_clear_errors() -> None:
    with pytest.raises(EventError, match="mode"):
        SessionLog("s", mode="lenient")  # type: ignore[arg-type]
    log = SessionLog("s")
    with pytest.raises(EventError, match="seq-in-log"):
        log.messages_at(0)
    assert log.messages_at(-1) == ()


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON value (the value itself included)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found.extend(_paths(child, (*prefix, key)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found.extend(_paths(child, (*prefix, index)))
    return found


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_subtree_replaced_by_any_json_gives_event_error_or_passes(data: Any) -> None:
    """Structural fuzz: validators never crash on odd shapes, whatever the mode."""
    objs = base_log()
    index = data.draw(st.integers(0, len(objs) - 1))
    paths = [p for p in _paths(objs[index]) if p]
    path = data.draw(st.sampled_from(paths))
    target: Any = objs[index]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(lossless_json(6))
    mode = data.draw(st.sampled_from(["strict", "ingest"]))
    log = SessionLog("s", mode=mode)
    try:
        for obj in objs:
            log.append(event_from_json(obj))
    except EventError as exc:
        assert exc.rule and str(exc)
    log.messages()
