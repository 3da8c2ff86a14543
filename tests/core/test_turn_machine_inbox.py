"""Inbox commands (JSON form, validation) and the two inbox lists."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pipeline.core.errors import EventError
from pipeline.core.inbox import (
    Cancel,
    Configure,
    FollowUp,
    InboxLists,
    Inject,
    Steer,
    command_from_json,
    command_to_json,
)

TEXT = ({"type": "text", "text": "hi"},)


@pytest.mark.parametrize("command", [
    FollowUp("s", "m1", TEXT), Steer("s", "m2", TEXT, source={"kind": "api", "by": "ops"}),
    Inject("s", "m3", TEXT), Cancel("s", "c1", keep_queue=True),
    Configure("s", "c2", provider="deepseek", model="m", system="sys", tools=("echo",),
              reasoning_effort="high", max_tokens=512),
    Configure("s", "c3"),
])
def test_json_round_trip(command: Any) -> None:
    assert command_from_json(command_to_json(command)) == command


@pytest.mark.parametrize(("obj", "problem"), [
    ({"kind": "followup", "sessionId": "s", "messageId": "m", "content": []}, "non-empty list"),
    ({"kind": "followup", "sessionId": "", "messageId": "m", "content": list(TEXT)},
     "session_id"),
    ({"kind": "steer", "sessionId": "s", "messageId": "m", "content": [{"text": "x"}]},
     "content[0]"),
    ({"kind": "inject", "sessionId": "s", "messageId": "m", "content": list(TEXT),
      "source": "user"}, "source must be an object"),
    ({"kind": "cancel", "sessionId": "s", "messageId": "m", "keepQueue": "yes"}, "keepQueue"),
    ({"kind": "configure", "sessionId": "s", "messageId": "m", "maxTokens": 0}, "max_tokens"),
    ({"kind": "configure", "sessionId": "s", "messageId": "m", "tools": "echo"}, "tools"),
    ({"kind": "launch", "sessionId": "s", "messageId": "m"}, "unknown command kind"),
    ([1], "JSON object"),
])
def test_bad_commands_are_refused_with_the_field_named(obj: Any, problem: str) -> None:
    with pytest.raises(EventError, match=re.escape(problem)):
        command_from_json(obj)


def test_lists_log_every_change_and_rebuild_from_the_log() -> None:
    lists = InboxLists()
    splices = [lists.insert(FollowUp("s", "f1", TEXT)), lists.insert(FollowUp("s", "f2", TEXT)),
               lists.insert(Inject("s", "i1", TEXT)), lists.insert(Steer("s", "s1", TEXT))]
    assert [s["start"] for s in splices] == [0, 1, 0, 1]
    assert lists.wakes and lists.steered
    _, claim = lists.claim_next_turn()
    splices.append(claim)
    rebuilt = InboxLists()
    for seq, splice in enumerate(splices):
        rebuilt.apply_splice(splice, seq=seq)
    assert [i.message["id"] for i in rebuilt.next_turn] == ["f2"]
    assert [i.message["id"] for i in rebuilt.next_step] == ["i1", "s1"]
    # the injected context (source kind "context") waits; the steer (kind "user") wakes
    assert [i.wakes for i in rebuilt.next_step] == [False, True]
    with pytest.raises(EventError, match="do not fit"):
        rebuilt.apply_splice({"target": "next-turn", "start": 0, "removedCount": 5,
                              "inserted": []}, seq=9)
