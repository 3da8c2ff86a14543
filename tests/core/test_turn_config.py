"""A configure is logged (``dsh-pipeline/config``, ignorable) and a rebuild restores it.

The turn machine appends the event when it applies the command; a machine rebuilt from the
log, whatever its default configuration, uses exactly the last applied configuration; the
event carries no secret; every reader of the log (surface fold, derive, crash repair, check,
the processors' fold, usage, fleet, the Avro codec, session files) accepts or skips it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from folding_support import Harness as FoldHarness
from test_turn_machine import normalized, run_turn
from test_turn_machine_harness import CONFIG, Attempt, Harness, new_machine, text_reply, tool_reply

from pipeline.codec.avro import EventSerde
from pipeline.codec.sessionfile import read_session_file, write_session_file
from pipeline.core.errors import ConfigError, InvariantViolation, TurnError
from pipeline.core.events import Event, event_from_json
from pipeline.core.fleet import FleetStatus
from pipeline.core.inbox import Configure, FollowUp, command_from_json
from pipeline.core.log import SessionLog, derive_messages
from pipeline.core.turn_config import (
    CONFIG_TYPE,
    ConfigState,
    config_disagreements,
    configured_header,
)
from pipeline.core.turn_effects import CallModel, SessionConfig
from pipeline.core.turn_machine import TurnMachine
from pipeline.core.usage import UsageScan
from pipeline.services.replay.check import check_session
from pipeline.services.replay.topic import LoggedEvent

ECHO_DEFINITION = {"name": "echo", "description": "echo", "parameters": {"type": "object"}}
FULL = Configure("s1", "c-full", provider="scripted", model="configured-model",
                 system="be brief", tools=("echo",), reasoning_effort="high", max_tokens=64)
OTHER_DEFAULT = SessionConfig("deepseek-official", "some-default-model")


def follow_up(text: str, message_id: str) -> FollowUp:
    return FollowUp("s1", message_id, ({"type": "text", "text": text},))


def configured(machine: TurnMachine, command: Configure = FULL, now: int = 5) -> list[Event]:
    tools = (ECHO_DEFINITION,) if command.tools is not None else None
    assert machine.submit(command, now, tools=tools)
    return machine.take_events()


def rebuilt(events: list[Event] | tuple[Event, ...], default: SessionConfig | None = OTHER_DEFAULT
            ) -> TurnMachine:
    return new_machine(SessionLog.from_events("s1", events, mode="strict"), config=default)


def log_of(machine: TurnMachine) -> list[Event]:
    return list(machine.log.events)


# -- the event -------------------------------------------------------------------------------


def test_a_configure_appends_one_ignorable_event_with_the_whole_configuration() -> None:
    machine = new_machine()
    [event] = configured(machine)
    assert event.type == CONFIG_TYPE and event.ignorable is True
    assert event.surface_op is None and event.source_event_seqs is None
    assert event.data == {"messageId": "c-full", "header": {
        "config": {"provider": "scripted", "model": "configured-model",
                   "reasoningEffort": "high", "maxTokens": 64},
        "system": "be brief", "tools": [ECHO_DEFINITION]}}
    # a later partial configure logs the whole configuration in force, not the change
    [later] = configured(machine, Configure("s1", "c-2", max_tokens=9))
    assert later.data["header"]["config"] == {"provider": "scripted", "model": "configured-model",
                                              "reasoningEffort": "high", "maxTokens": 9}
    assert later.data["header"]["system"] == "be brief"


def test_a_refused_configure_logs_nothing() -> None:
    machine = new_machine(config=None)
    with pytest.raises(ConfigError, match="provider and a model"):
        machine.submit(Configure("s1", "c1", model="m"), 1)
    with pytest.raises(TurnError, match="resolved definitions"):
        machine.submit(Configure("s1", "c2", provider="p", model="m", tools=("echo",)), 1)
    assert machine.take_events() == [] and len(machine.log.events) == 0
    assert machine.config is None


def test_an_api_key_sent_with_a_configure_never_reaches_the_log() -> None:
    secret = "sk-never-in-the-log-0123456789"
    command = command_from_json({"kind": "configure", "sessionId": "s1", "messageId": "c1",
                                 "provider": "deepseek", "model": "deepseek-chat",
                                 "apiKey": secret, "api_key": secret})
    machine = new_machine()
    assert machine.submit(command, 1)
    machine.submit(follow_up("hi", "m1"), 2)
    Harness(machine, iter([Attempt(text_reply("a"))])).run()
    text = "\n".join(json.dumps(e.to_json()) for e in machine.log.events)
    assert secret not in text
    [event] = [e for e in machine.log.events if e.type == CONFIG_TYPE]
    assert set(event.data) == {"messageId", "header"}
    assert set(event.data["header"]) <= {"config", "system", "tools"}
    assert set(event.data["header"]["config"]) <= {"provider", "model", "reasoningEffort",
                                                   "maxTokens"}


# -- the rebuild -----------------------------------------------------------------------------


def test_a_rebuild_restores_a_configure_no_turn_used_yet() -> None:
    machine = new_machine()
    run_turn(Attempt(text_reply("a")), machine=machine)
    configured(machine)
    again = rebuilt(log_of(machine))
    assert again.config == machine.config == SessionConfig(
        "scripted", "configured-model", "be brief", (ECHO_DEFINITION,), "high", 64)
    events, harness = run_turn(Attempt(text_reply("b")), machine=again,
                               command=follow_up("next", "m2"))
    [request] = harness.requests
    assert (request.provider, request.model, request.system, request.max_tokens,
            request.reasoning_effort) == ("scripted", "configured-model", "be brief", 64, "high")
    header = next(e for e in events if e.type == "request/header")
    assert header.data["reason"] == "change"  # as the machine that applied it would log
    message = next(e for e in events if e.type == "assistant/message")
    assert message.data["message"]["source"]["model"] == "configured-model"


def test_a_rebuild_restores_a_first_configure_of_a_session_without_default() -> None:
    machine = new_machine(config=None)
    configured(machine)
    again = rebuilt(log_of(machine), default=None)
    events, harness = run_turn(Attempt(text_reply("b")), machine=again,
                               command=follow_up("first", "m1"))
    assert harness.requests[0].model == "configured-model"
    header = next(e for e in events if e.type == "request/header")
    assert header.data["reason"] == "initial"
    assert header.data["header"] == next(
        e for e in log_of(again) if e.type == CONFIG_TYPE).data["header"]


def _scenario(rebuild_after_configure: bool) -> list[Event]:
    machine = new_machine()
    run_turn(Attempt(text_reply("a")), machine=machine, command=follow_up("one", "m1"))
    configured(machine, Configure("s1", "c1", model="configured-model", max_tokens=7), 50)
    if rebuild_after_configure:
        machine = rebuilt(log_of(machine))
    run_turn(Attempt(tool_reply(("k1", "echo", "{}"))), Attempt(text_reply("b")),
             machine=machine, command=follow_up("two", "m2"))
    return log_of(machine)


def test_a_log_continued_after_a_rebuild_equals_the_uninterrupted_one() -> None:
    assert normalized(_scenario(True)) == normalized(_scenario(False))


def test_a_configure_mid_turn_survives_a_crash_of_that_turn() -> None:
    machine = new_machine()
    harness = Harness(machine, iter([]))
    machine.submit(follow_up("hi", "m1"), 1)
    effect = machine.next_effect(harness.now())
    while not isinstance(effect, CallModel):
        harness._perform(effect)
        effect = machine.next_effect(harness.now())
    configured(machine, Configure("s1", "c1", model="after-crash"), harness.now())
    for chunk in text_reply("partial")[:2]:
        machine.chunk(chunk, harness.now())
    # the driver dies here: the next owner repairs the open turn and keeps the configuration
    again = rebuilt(log_of(machine))
    events, second = run_turn(Attempt(text_reply("b")), machine=again,
                              command=follow_up("next", "m2"))
    assert [e.data["reason"]["kind"] for e in events if e.type == "turn/end"] == [
        "interrupted", "completed"]
    assert second.requests[0].model == "after-crash"
    assert config_disagreements(log_of(again)) == []


def test_a_redelivered_configure_is_recognised_from_the_log() -> None:
    machine = new_machine()
    configured(machine)
    assert not machine.submit(FULL, 9, tools=(ECHO_DEFINITION,))
    again = rebuilt(log_of(machine))
    assert not again.submit(FULL, 10, tools=(ECHO_DEFINITION,))
    assert again.take_events() == []


def test_a_config_event_another_writer_shaped_differently_is_carried_not_applied() -> None:
    foreign = [
        Event(CONFIG_TYPE, 0, 1, {"messageId": "x", "header": {"config": {"model": "m"}}},
              ignorable=True),
        Event(CONFIG_TYPE, 1, 2, {"messageId": "y", "header": {
            "config": {"provider": "p", "model": "m"}, "extra": 1}}, ignorable=True),
        Event(CONFIG_TYPE, 2, 3, "not an object", ignorable=True),
    ]
    assert [configured_header(e.data) for e in foreign] == [None, None, None]
    machine = rebuilt(foreign)
    assert machine.config == OTHER_DEFAULT
    events, _ = run_turn(Attempt(text_reply("b")), machine=machine, command=follow_up("x", "m"))
    assert SessionLog.from_events("s1", [*foreign, *events], mode="strict").events


# -- the header and the config event never disagree ------------------------------------------


def test_every_header_after_a_config_event_states_it() -> None:
    events = _scenario(False)
    config = next(e for e in events if e.type == CONFIG_TYPE)
    headers = [e for e in events if e.type == "request/header" and e.seq > config.seq]
    assert [h.data["header"] for h in headers] == [config.data["header"]]
    assert config_disagreements(events) == []
    tampered = [e if e is not headers[0] else Event(
        e.type, e.seq, e.time, {"header": {"config": {"provider": "x", "model": "y"}},
                                "reason": "change"}) for e in events]
    assert config_disagreements(tampered) == [
        f"seq {headers[0].seq}: request/header differs from the configuration logged at "
        f"seq {config.seq}"]


def test_a_header_that_would_differ_from_the_last_configuration_is_refused() -> None:
    state = ConfigState(header=None, configured=None, configured_last=False,
                        message_ids=set(), default=CONFIG)
    state.configure(Configure("s1", "c1", model="m1"), None)
    state.configured = {"config": {"provider": "deepseek-official", "model": "other"}}
    with pytest.raises(InvariantViolation, match="differs from the last logged configuration"):
        state.header_due()


# -- every reader accepts the event ----------------------------------------------------------


def _with_and_without() -> tuple[list[Event], list[Event]]:
    """The same session with a configure that changes nothing, and without it."""
    def run(with_configure: bool) -> list[Event]:
        machine = new_machine()
        if with_configure:
            configured(machine, Configure("s1", "c0", provider=CONFIG.provider,
                                          model=CONFIG.model), 2)
        run_turn(Attempt(tool_reply(("k1", "echo", "{}"))), Attempt(text_reply("a")),
                 machine=machine, command=follow_up("one", "m1"))
        if with_configure:
            configured(machine, Configure("s1", "c1", model=CONFIG.model), 90)
        run_turn(Attempt(text_reply("b")), machine=machine, command=follow_up("two", "m2"))
        return log_of(machine)
    return run(True), run(False)


def test_a_log_with_config_events_derives_the_same_messages() -> None:
    with_events, without = _with_and_without()
    assert sum(e.type == CONFIG_TYPE for e in with_events) == 2
    for mode in ("strict", "ingest"):
        assert derive_messages(with_events, mode=mode) == derive_messages(without, mode=mode)
    as_json = [event_from_json(json.loads(json.dumps(e.to_json()))) for e in with_events]
    assert derive_messages(as_json) == derive_messages(without)


def test_check_usage_and_fleet_accept_the_event() -> None:
    with_events, without = _with_and_without()
    report = check_session("s1", [LoggedEvent(e, 0, i) for i, e in enumerate(with_events)],
                           now_ms=10**13, open_turn_max_age_ms=1)
    assert report.ok and report.problems == []
    scans = [UsageScan(), UsageScan()]
    scans[0].add_log("s1", with_events)
    scans[1].add_log("s1", without)
    assert scans[0] == scans[1]
    fleet = FleetStatus("s1")
    config_event = next(e for e in with_events if e.type == CONFIG_TYPE)
    # the status does not change but its last seq does: published, state untouched
    assert fleet.apply(config_event) is True and fleet.state == "idle"
    assert fleet.last_seq == config_event.seq


def test_check_reports_a_header_that_differs_from_the_logged_configuration() -> None:
    events = _scenario(False)
    config = next(e for e in events if e.type == CONFIG_TYPE)
    header = next(e for e in events if e.type == "request/header" and e.seq > config.seq)
    tampered = [e if e is not header else Event(
        e.type, e.seq, e.time, {"header": {"config": {"provider": "x", "model": "y"}},
                                "reason": "change"}) for e in events]
    report = check_session("s1", [LoggedEvent(e, 0, i) for i, e in enumerate(tampered)],
                           now_ms=10**13, open_turn_max_age_ms=1)
    assert not report.ok and report.config_disagreements == 1
    assert report.problems == [f"s1: seq {header.seq}: request/header differs from the "
                               f"configuration logged at seq {config.seq}"]


async def test_the_processors_fold_skips_the_event() -> None:
    with_events, without = _with_and_without()
    harness = FoldHarness()
    await harness.feed([harness.record("s1", e) for e in with_events])
    assert harness.messages("s1") == list(derive_messages(without))
    assert harness.counters.dead_letters == 0 and harness.counters.invalid_events == 0


def test_the_avro_codec_and_session_files_carry_the_event_losslessly(tmp_path: Path) -> None:
    with_events, _ = _with_and_without()
    serde = EventSerde()
    for event in with_events:
        session_id, decoded = serde.decode(serde.encode("s1", event))
        assert (session_id, decoded.to_json()) == ("s1", event.to_json())
    for name in ("s.jsonl", "s.jsonl.zstd"):
        write_session_file(tmp_path / name, with_events, packed=True)
        read: Any = read_session_file(tmp_path / name)
        assert [e.to_json() for e in read.events] == [e.to_json() for e in with_events]
