"""Pure parts of fan-out and replay: the renderer, key order, durations, import planning,
projection differences, the checker on the fixtures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from fanout_support import FIXTURES

from pipeline.cli.common import parse_duration_ms
from pipeline.codec.sessionfile import encode_lines, read_session_file
from pipeline.core.errors import EventError
from pipeline.core.events import Event
from pipeline.services.replay.check import check_session
from pipeline.services.replay.rebuild import differences
from pipeline.services.replay.render import Renderer, transcript
from pipeline.services.replay.topic import LoggedEvent
from pipeline.services.replay.transfer import new_events, session_id_for

ALL_FIXTURES = [*sorted(FIXTURES.glob("*.jsonl")), FIXTURES.parent / "seed-example.jsonl"]


def _chunk(seq: int, text: str, kind: str = "text-delta") -> Event:
    return Event("assistant/chunk", seq, 0, {"turn": 1, "step": 1,
                                             "chunk": {"type": kind, "index": 0, "text": text}})


def test_streaming_text_is_assembled_inline_and_not_repeated_by_the_message() -> None:
    events = [Event("turn/start", 0, 0, {"turn": 1}), Event("step/start", 1, 0,
                                                             {"turn": 1, "step": 1}),
              _chunk(2, "think", "reasoning-delta"), _chunk(3, "Hel"), _chunk(4, "lo"),
              Event("assistant/message", 5, 0, {"turn": 1, "step": 1, "message": {
                  "role": "assistant", "content": [{"type": "text", "text": "Hello"}]}},
                  "append", ()),
              Event("turn/end", 6, 0, {"turn": 1, "reason": {"kind": "completed"}})]
    text = "".join(transcript("s", events))
    assert text == ("▶ turn 1\n  step 1\n    thinking: think\n    assistant: Hello\n"
                    "■ turn 1 completed\n")


def test_colours_only_when_asked_and_session_prefix_with_many_sessions() -> None:
    event = Event("turn/start", 0, 0, {"turn": 2})
    assert Renderer().feed("s", event) == "▶ turn 2\n"
    coloured = Renderer(colour=True, show_session=True).feed("s", event)
    assert coloured == "[s] \x1b[1;34m▶ turn 2\x1b[0m\n"


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: p.stem)
def test_fixtures_render_and_check_clean(path: Path) -> None:
    events = read_session_file(path).events
    text = "".join(transcript(path.stem, list(events)))
    assert text.count("▶ turn") == sum(e.type == "turn/start" for e in events)
    report = check_session(path.stem, [LoggedEvent(e, 0, i) for i, e in enumerate(events)],
                           now_ms=events[-1].time, open_turn_max_age_ms=3_600_000)
    assert report.ok, report.problems


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.jsonl")), ids=lambda p: p.stem)
def test_read_events_reproduce_dsh_lines_exactly(path: Path) -> None:
    read = read_session_file(path)  # envelope key order is kept in Event.key_order
    lines = encode_lines(read.events, header=read.header, packed=True)
    assert "".join(f"{line}\n" for line in lines) == path.read_text()


def test_durations() -> None:
    assert [parse_duration_ms(t) for t in ("1h", "30m", "90s", "250ms", "2d", "5")] == [
        3_600_000, 1_800_000, 90_000, 250, 172_800_000, 5000]
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        parse_duration_ms("soon")


def test_import_plan_skips_what_the_topic_holds_and_refuses_a_conflict() -> None:
    events = list(read_session_file(FIXTURES / "text-turn.jsonl").events)
    assert new_events("f", "s", events, events[:3]) == events[3:]
    assert new_events("f", "s", events[:3], events) == []  # the topic is ahead
    changed = Event(events[2].type, 2, events[2].time + 1, events[2].data)
    with pytest.raises(EventError, match=r"f: session 's' conflicts.*\[rule: import-conflict\]"):
        new_events("f", "s", events, [*events[:2], changed])


def test_session_ids_from_header_folder_or_name() -> None:
    assert session_id_for("a/b/session.jsonl", {"id": "h"}) == "h"
    assert session_id_for("a/b/session.jsonl.zstd", None) == "b"
    assert session_id_for("a/x.jsonl", {"type": "session"}) == "x"


def test_every_difference_is_listed() -> None:
    live = {"a": [{"m": 1}, {"m": 2}], "b": [{"m": 1}]}
    new = {"a": [{"m": 1}, {"m": 3}, {"m": 4}], "c": []}
    assert differences(live, new) == [
        'a: message 1 differs: live {"m":2} != new {"m":3}',
        'a: message 2 differs: live (none) != new {"m":4}',
        "b: missing in the new version", "c: missing in the live"]
    assert json.dumps(differences(live, live)) == "[]"


def test_sessions_that_moved_during_a_rebuild_are_counted_not_compared() -> None:
    from pipeline.services.replay.compare import moved_sessions

    live = {"a": [{"m": 1}], "b": [{"m": 2}], "c": [{"m": 3}]}
    new = {"a": [{"m": 1}], "b": [{"m": 2}, {"m": 4}], "c": [{"m": 9}]}
    moved = moved_sessions({"a": 5, "b": 7, "c": 9}, {"a": 5, "b": 12, "c": 9, "d": 1})
    assert moved == {"b"}  # b's live version is at another seq; d is new, not moved
    assert differences(live, new, "v0", skip=moved) == [
        'c: message 0 differs: v0 {"m":3} != new {"m":9}']
