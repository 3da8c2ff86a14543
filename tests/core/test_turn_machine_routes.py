"""The turn machine's provider routes (issue 30: provider fallback), without I/O.

A machine made with ``routing=True`` asks which route each step takes before its header; a
failure may move the call to a fallback at once. What the log says: the ``request/header``
names the route the request went to (reason ``change``, dsh's word for a new provider/model),
a ``dsh-pipeline/route`` event (ignorable) says which configured model it stands in for and
why, ``llm/retry`` says the call moved, and the ``assistant/message`` source names who
answered, so usage is counted under that model. Every request still equals what the log
derives, a configured session's headers still agree with its configuration, and a rebuild
(from the whole log or a checkpoint's History) knows the configured model, not the fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from test_turn_machine_harness import Attempt, Harness, new_machine, text_reply

from pipeline.codec.avro import EventSerde
from pipeline.core.errors import ProviderError
from pipeline.core.events import Event
from pipeline.core.inbox import Cancel, Configure, FollowUp
from pipeline.core.log import SessionLog, derive_messages
from pipeline.core.model import RetryPolicy
from pipeline.core.provider_routes import ROUTE_TYPE, Route
from pipeline.core.turn_config import config_disagreements
from pipeline.core.turn_effects import ChooseRoute, SessionConfig, StepBoundary
from pipeline.core.turn_history import History, scan_history
from pipeline.core.turn_machine import TurnMachine
from pipeline.core.usage import UsageScan

PRIMARY, BACKUP = Route("deepseek", "deepseek-chat"), Route("backup", "gpt-4o-mini")
CONFIG = SessionConfig(PRIMARY.provider, PRIMARY.model, system="be brief")
SERVER_ERROR = ProviderError("deepseek answered HTTP 500 (SERVER): down", code="SERVER",
                             status=500)


def follow_up(text: str, message_id: str) -> FollowUp:
    return FollowUp("s1", message_id, ({"type": "text", "text": text},))


def always(route: Route, reason: str = "primary") -> Callable[[ChooseRoute], tuple[Route, str]]:
    return lambda _effect: (route, reason)


def harness(machine: TurnMachine, *attempts: Attempt, route: Route = PRIMARY,
            reason: str = "primary", fallback: Route | None = None) -> Harness:
    return Harness(machine, iter(attempts), route=always(route, reason),
                   fallback=(lambda _error: fallback))


def routing_machine(log: SessionLog | None = None, *, retry: RetryPolicy | None = None,
                    config: SessionConfig | None = CONFIG, history: History | None = None,
                    routing: bool = True) -> TurnMachine:
    return new_machine(log, config=config, routing=routing, history=history,
                       retry=retry or RetryPolicy(max_attempts=1))


def types(events: list[Event]) -> list[str]:
    return [e.type for e in events if e.type != "assistant/chunk"]


def of_type(events: list[Event] | tuple[Event, ...], type_: str) -> list[Event]:
    return [e for e in events if e.type == type_]


def source_of(events: list[Event]) -> dict[str, Any]:
    [message] = of_type(events, "assistant/message")
    return dict(message.data["message"]["source"])  # type: ignore[index]


def turn_on_backup_after_a_failure(machine: TurnMachine) -> tuple[Harness, list[Event]]:
    machine.submit(follow_up("hi", "m1"), 1)
    h = harness(machine, Attempt([], SERVER_ERROR), Attempt(text_reply("from backup")),
                fallback=BACKUP)
    return h, h.run()


def test_a_failure_moves_the_call_to_the_fallback_and_the_log_says_so() -> None:
    machine = routing_machine()
    h, events = turn_on_backup_after_a_failure(machine)
    assert types(events) == [
        "agent/inbox/spliced", "turn/start", "agent/inbox/spliced", "step/start",
        "user/message", "request/header", "request/context",
        "llm/retry", "llm/retry-started", ROUTE_TYPE, "request/header", "request/context",
        "assistant/message", "step/end", "turn/end"]
    first, second = of_type(events, "request/header")
    assert first.data["header"]["config"] == PRIMARY.to_json()  # type: ignore[index]
    assert second.data == {"header": {"config": BACKUP.to_json(), "system": "be brief"},
                           "reason": "change"}
    [retry] = of_type(events, "llm/retry")
    assert retry.data == {"turn": 1, "step": 1, "attempt": 1, "delayMs": 0,
                          "error": {"message": str(SERVER_ERROR), "code": "SERVER",
                                    "status": 500},
                          "fallback": BACKUP.to_json()}
    [route] = of_type(events, ROUTE_TYPE)
    assert route.ignorable is True and route.data == {
        **BACKUP.to_json(), "reason": "failed", "primary": PRIMARY.to_json()}
    assert source_of(events) == {"kind": "model", **BACKUP.to_json()}
    assert [(r.provider, r.model) for r in h.requests] == [
        (PRIMARY.provider, PRIMARY.model), (BACKUP.provider, BACKUP.model)]
    assert h.sleeps == []  # the fallback is called at once
    assert of_type(events, "turn/end")[0].data["reason"] == {"kind": "completed"}  # type: ignore[index]


def test_usage_of_a_fallback_answer_is_counted_under_the_model_that_answered() -> None:
    machine = routing_machine()
    _, events = turn_on_backup_after_a_failure(machine)
    scan = UsageScan()
    scan.add_log("s1", events)
    assert set(scan.by_model) == {BACKUP.key}


def test_the_fallback_has_a_retry_budget_of_its_own() -> None:
    machine = routing_machine(retry=RetryPolicy(max_attempts=2, base_ms=0, max_ms=0))
    machine.submit(follow_up("hi", "m1"), 1)
    failing = [Attempt([], SERVER_ERROR)] * 3
    h = harness(machine, *failing, Attempt(text_reply("ok")), fallback=BACKUP)
    h.fallback = lambda _e: BACKUP if machine.would_retry(SERVER_ERROR) is False \
        and h.requests[-1].provider == PRIMARY.provider else None
    events = h.run()
    assert [r.provider for r in h.requests] == ["deepseek", "deepseek", "backup", "backup"]
    assert [e.data["attempt"] for e in of_type(events, "llm/retry")] == [1, 2, 3]  # type: ignore[index]
    assert ["fallback" in e.data for e in of_type(events, "llm/retry")] == [  # type: ignore[operator]
        False, True, False]
    assert source_of(events)["provider"] == "backup"


def test_a_step_may_start_on_a_fallback_and_come_back_to_the_configured_model() -> None:
    machine = routing_machine()
    machine.submit(follow_up("hi", "m1"), 1)
    events = harness(machine, Attempt(text_reply("a")), route=BACKUP,
                     reason="over-budget").run()
    assert types(events)[4:7] == ["user/message", ROUTE_TYPE, "request/header"]
    assert of_type(events, "request/header")[0].data["reason"] == "initial"  # type: ignore[index]
    assert of_type(events, ROUTE_TYPE)[0].data["reason"] == "over-budget"  # type: ignore[index]
    # the next step on the same route logs nothing new
    machine.submit(follow_up("again", "m2"), 2)
    events = harness(machine, Attempt(text_reply("b")), route=BACKUP).run()
    assert of_type(events, ROUTE_TYPE) == [] and of_type(events, "request/header") == []
    # back on the configured model: a route event and a header saying so
    machine.submit(follow_up("later", "m3"), 3)
    events = harness(machine, Attempt(text_reply("c"))).run()
    [route] = of_type(events, ROUTE_TYPE)
    assert route.data == {**PRIMARY.to_json(), "reason": "primary",
                          "primary": PRIMARY.to_json()}
    [header] = of_type(events, "request/header")
    assert header.data["header"]["config"] == PRIMARY.to_json()  # type: ignore[index]
    assert header.data["reason"] == "change"  # type: ignore[index]
    assert source_of(events)["provider"] == PRIMARY.provider


def rebuilt(events: tuple[Event, ...], *, routing: bool, via_checkpoint: bool = False
            ) -> TurnMachine:
    log = SessionLog.from_events("s1", events, mode="strict")
    history = None
    if via_checkpoint:
        history = History.from_json(scan_history(events).to_json())
    return routing_machine(log, config=SessionConfig("scripted", "driver-default"),
                           history=history, routing=routing)


def test_a_rebuild_on_a_fallback_knows_the_configured_model() -> None:
    machine = routing_machine()
    turn_on_backup_after_a_failure(machine)
    events = machine.log.events
    for via_checkpoint in (False, True):
        again = rebuilt(events, routing=True, via_checkpoint=via_checkpoint)
        assert again.config is not None
        assert (again.config.provider, again.config.model) == (PRIMARY.provider, PRIMARY.model)
        again.submit(follow_up("next", "m2"), 50)
        h = harness(again, Attempt(text_reply("still backup")), route=BACKUP)
        later = h.run()
        assert of_type(later, "request/header") == []   # the logged header names BACKUP
        assert h.requests[0].provider == BACKUP.provider


def test_a_rebuild_without_fallbacks_goes_back_to_the_configured_model() -> None:
    machine = routing_machine()
    turn_on_backup_after_a_failure(machine)
    again = rebuilt(machine.log.events, routing=False)
    again.submit(follow_up("next", "m2"), 50)
    h = Harness(again, iter([Attempt(text_reply("primary again"))]))
    later = h.run()
    [header] = of_type(later, "request/header")
    assert header.data == {"header": {"config": PRIMARY.to_json(), "system": "be brief"},
                           "reason": "resume"}
    assert h.requests[0].provider == PRIMARY.provider
    assert source_of(later)["provider"] == PRIMARY.provider


def test_a_configured_session_on_a_fallback_still_agrees_with_its_configuration() -> None:
    machine = routing_machine(config=None)
    assert machine.submit(Configure("s1", "c1", provider=PRIMARY.provider,
                                    model=PRIMARY.model, system="configured"), 1)
    turn_on_backup_after_a_failure(machine)
    events = list(machine.log.events)
    assert config_disagreements(events) == []
    again = rebuilt(machine.log.events, routing=True)
    assert again.config == SessionConfig(PRIMARY.provider, PRIMARY.model, system="configured")
    # a header naming another model with no route event standing for it is reported
    forged = [e for e in events if e.type != ROUTE_TYPE]
    assert len(config_disagreements(forged)) == 1


def test_a_cancel_while_the_route_is_chosen_closes_the_step() -> None:
    machine = routing_machine()
    machine.submit(follow_up("hi", "m1"), 1)
    h = harness(machine)
    effect = machine.next_effect(2)
    while not isinstance(effect, ChooseRoute):
        h._perform(effect)
        effect = machine.next_effect(h.now())
    machine.submit(Cancel("s1", "x1", keep_queue=True), 10)
    assert isinstance(machine.next_effect(11), StepBoundary)
    events = machine.take_events()
    assert types(events)[-2:] == ["step/end", "turn/end"]
    assert of_type(events, "request/header") == []  # no call was made: no header owed yet


def test_every_reader_carries_a_fallback_turn() -> None:
    """The Avro codec gives the events back as they were; a strict rebuild accepts the log;
    the derived conversation holds the backup's answer (the route event projects nothing)."""
    machine = routing_machine()
    turn_on_backup_after_a_failure(machine)
    serde = EventSerde()
    for event in machine.log.events:
        session_id, decoded = serde.decode(serde.encode("s1", event))
        assert session_id == "s1" and decoded == event
    log = SessionLog.from_events("s1", machine.log.events, mode="strict")
    [_, answer] = derive_messages(log.events)
    assert answer["source"] == {"kind": "model", **BACKUP.to_json()}  # type: ignore[index]
