"""``dsh-pipeline check`` on the real broker: every planted defect is found (gap, duplicate,
invalid event, unanswered tool call, open turn too old, undecodable record); clean sessions
pass; the JSON summary and the exit code say so."""

from __future__ import annotations

import asyncio
import json

import pytest
from fanout_support import FIXTURES, fanout_settings, publish

from pipeline.adapters.kafka.admin import ensure_topics
from pipeline.adapters.kafka.plain_producer import send_records
from pipeline.adapters.kafka.records import OutRecord
from pipeline.cli.main import main
from pipeline.codec.records import event_headers
from pipeline.codec.sessionfile import read_session_file
from pipeline.core.events import Event
from pipeline.settings import Settings

TEXT = read_session_file(FIXTURES / "text-turn.jsonl").events
TOOLS = read_session_file(FIXTURES / "tool-call-turn.jsonl").events
UNANSWERED = [
    Event("turn/start", 0, 1, {"turn": 1}),
    Event("step/start", 1, 1, {"turn": 1, "step": 1}),
    Event("tool/call", 2, 1, {"turn": 1, "step": 1, "callId": "c1", "name": "bash",
                              "arguments": "{}"}),
    Event("step/end", 3, 1, {"turn": 1, "step": 1}),
    Event("turn/end", 4, 1, {"turn": 1, "reason": {"kind": "completed"}}),
]


def _env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    monkeypatch.setenv("DSH_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("DSH_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("DSH_PARTITIONS", str(settings.partitions))


async def _plant(settings: Settings) -> None:
    await ensure_topics(settings)
    await publish(settings, "clean", TEXT)
    await publish(settings, "clean-tools", TOOLS)
    await publish(settings, "gap", [*TEXT[:5], *TEXT[6:]])
    await publish(settings, "duplicate", [*TEXT[:4], TEXT[3], *TEXT[4:]])
    await publish(settings, "invalid", [*TEXT[:2], Event("turn/start", 2, 1, {"turn": -1})])
    await publish(settings, "unanswered", UNANSWERED)
    await publish(settings, "open", [Event("turn/start", 0, 1_000, {"turn": 1})])
    garbage = OutRecord(settings.topics.session_events, b"garbage", b"not avro",
                        tuple(event_headers(TEXT[0])))
    await send_records(settings, [garbage])


@pytest.mark.broker
def test_check_finds_every_planted_defect(kafka_bootstrap: str, topic_prefix: str,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    settings = fanout_settings(kafka_bootstrap, topic_prefix)
    asyncio.run(_plant(settings))
    _env(monkeypatch, settings)

    assert main(["check"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert {k: summary[k] for k in ("sessions", "invalid_sessions", "gaps", "duplicates",
                                    "invalid_events", "unanswered_calls", "open_turns_too_old",
                                    "undecodable_records")} == {
        "sessions": 7, "invalid_sessions": 5, "gaps": 1, "duplicates": 1,
        "invalid_events": 1, "unanswered_calls": 1, "open_turns_too_old": 1,
        "undecodable_records": 1}
    problems = "\n".join(summary["problems"])
    for needle in ("gap: expected seq 5, found 6", "duplicate seq 3",
                   "invalid event", "[rule: turn-number]", "tool call 'c1' of turn 1",
                   "open: a turn has been open", "garbage"):
        assert needle in problems

    assert main(["check", "clean", "clean-tools"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert (clean["sessions"], clean["events"], clean["invalid_sessions"], clean["ok"]) == (
        2, len(TEXT) + len(TOOLS), 0, True)
    assert main(["check", "open", "--open-turn-max-age", "100000d"]) == 0
    assert main(["check", "nobody"]) == 1  # a named session that is not there
